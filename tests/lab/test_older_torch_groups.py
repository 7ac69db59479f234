"""A torch that does not ask the default group for new groups (before 2.12), on real ranks.

torch 2.12 on asks the lab's world handle to make every new group, so a
DeviceMesh's groups are the lab's handles (``rank.lab_groups``). An older torch
makes them itself; the lab then adopts a mesh's groups as handles when it
builds the mesh, so a rebuild in place remakes them too. Here the ranks are made
to behave as the older torch does (the world handle stops offering
``new_group``), and a run trains, its groups are rebuilt, and it trains on.
"""

from __future__ import annotations

import pytest

from labkit.wire.entry import this_rank

pytestmark = pytest.mark.lab

SMALL_GPT = dict(dim=32, heads=4, layers=2, seq=16, vocab=32)

AS_OLDER_TORCH = """
from labkit.rank import lab_groups
from labkit.torch_support import torch_internals
del lab_groups.WorldGroup.new_group
torch_internals.routes_new_groups = lambda: False
"""


def _mesh_groups():
    runtime = this_rank()
    return {recipe.name: id(handle.inner) for handle, recipe in runtime.groups.handles.items()
            if handle is not runtime.groups.world}


def test_a_mesh_made_by_an_older_torch_is_adopted_and_rebuilt_in_place():
    from tests.conftest import started_lab

    with started_lab(2, timeout=60) as lab:
        lab.run_cell(AS_OLDER_TORCH)
        first = lab.train("ddp", "gpt", steps=2, global_batch=8, verify=True, model_settings=SMALL_GPT,
                          log_every=100)
        assert first.equivalent
        before = lab.run(_mesh_groups)
        assert all(before), "the mesh's group must be one of the lab's handles"
        lab.session.rebuild_group()
        after = lab.run(_mesh_groups)
        assert [set(groups) for groups in after] == [set(groups) for groups in before]
        assert all(after[rank][name] != before[rank][name] for rank in range(2) for name in before[rank])
        again = lab.train("ddp", "gpt", steps=2, global_batch=8, verify=True, model_settings=SMALL_GPT,
                          log_every=100, resume=True)
        assert again.equivalent
