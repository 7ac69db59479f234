"""Training through groups that answer as nccl does: a real 4-rank lab on CPU, every group nccl-like.

Each rank's groups are rebuilt in place over ``tests/nccl_like_group.NcclLikeGroup``
(gloo that answers a synchronous collective with no work, as nccl does since torch
2.8, and coalesces sends and receives). Then FSDP's synchronous all-gathers and
reduce-scatters, tensor parallelism's setup broadcast, the hand-written gradient
all-reduce of ddp+tp, DiLoCo's outer all-reduce and a 1F1B pipeline train with
instruments on and verify equal to one process; a slow link slows them; the
pipeline's sends and receives are all posted in coalesced groups.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from labkit.wire.entry import this_rank

pytestmark = pytest.mark.lab

SMALL_GPT = dict(dim=32, heads=4, layers=4, seq=16, vocab=32)
FAKE = Path(__file__).parents[1] / "nccl_like_group.py"

CASES = [
    ("fsdp", None, {}),
    ("tp", None, {}),
    ("ddp+tp", dict(dp=2, tp=2), {}),
    ("diloco", None, dict(inner_steps=2)),
    ("pp", None, dict(schedule="1f1b", micro_batches=4)),
]


def _counts():
    import sys

    return sys.modules["nccl_like_group"].counts(this_rank().groups)


@pytest.fixture(scope="module")
def nccl_like_lab():
    from tests.conftest import started_lab

    with started_lab(4, timeout=60) as lab:
        lab.run_cell(
            "import importlib.util, sys\n"
            f"_spec = importlib.util.spec_from_file_location('nccl_like_group', {str(FAKE)!r})\n"
            "_fake = importlib.util.module_from_spec(_spec)\n"
            "sys.modules['nccl_like_group'] = _fake\n"
            "_spec.loader.exec_module(_fake)\n"
            "from labkit.torch_support import torch_internals\n"
            "_fake.install(torch_internals)\n"
        )
        lab.session.rebuild_group()  # every group of every rank, the world too, is nccl-like from here on
        assert all(found["groups"] >= 1 for found in lab.run(_counts))
        yield lab


@pytest.mark.parametrize("strategy, mesh, extra", CASES, ids=[case[0] for case in CASES])
def test_trains_and_verifies_through_groups_that_answer_no_work(nccl_like_lab, strategy, mesh, extra):
    before = nccl_like_lab.run(_counts)
    report = nccl_like_lab.train(strategy, "gpt", steps=4, mesh=mesh, global_batch=16, verify=True,
                                 instruments=True, model_settings=SMALL_GPT, log_every=100, **extra)
    assert report.equivalent, str(report)
    assert all(math.isfinite(loss) for loss in report.losses)
    rows = [row for result in report.results for row in result.get("rows") or []]
    assert rows and all(row["seconds"] > 0 for row in rows)
    assert any(row["comm"] for row in rows), "the collectives that answered no work must still be timed"
    after = nccl_like_lab.run(_counts)
    assert sum(a["answered_none"] - b["answered_none"] for a, b in zip(after, before)) > 0
    if strategy == "pp":
        assert sum(a["p2p_grouped"] - b["p2p_grouped"] for a, b in zip(after, before)) > 0
        assert [a["p2p_alone"] - b["p2p_alone"] for a, b in zip(after, before)] == [0, 0, 0, 0]


def test_a_slow_link_slows_training_through_groups_that_answer_no_work(nccl_like_lab):
    fast = nccl_like_lab.train("fsdp", "gpt", steps=3, global_batch=16, instruments=False,
                               model_settings=SMALL_GPT, log_every=100)
    nccl_like_lab.link(latency="20ms")
    try:
        slow = nccl_like_lab.train("fsdp", "gpt", steps=3, global_batch=16, instruments=False,
                                   model_settings=SMALL_GPT, log_every=100)
    finally:
        nccl_like_lab.link("off")
    # Four layers: an all-gather each forward, and the backward's, 20 ms apiece at least.
    assert slow.median_step_seconds > fast.median_step_seconds + 0.1
