"""What code written for torchrun finds on a lab's ranks (4 real gloo ranks).

torchrun's environment variables, an independent random state per rank (forked
ranks would otherwise share the process host's), seeds set on request, and no
state left from a process group that a rebuild replaced.
"""

import ast
import os
import signal
import time

import pytest

from labkit import LabConfigError, RankFailure

from tests.conftest import ipython_shell

pytestmark = pytest.mark.lab

ENVIRONMENT = "{k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}"


def shown(values):
    return [ast.literal_eval(value) for value in values]


def test_torchrun_environment_and_after_a_rebuild(lab):
    lab.run_cell("import os")
    before = shown(lab.run_cell(ENVIRONMENT))
    for rank, env in enumerate(before):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "localhost" and int(env["MASTER_PORT"]) > 0  # as torchrun --standalone
    with pytest.raises(RankFailure):
        lab.run_cell("raise ValueError('an ordinary mistake')")
    assert shown(lab.run_cell(ENVIRONMENT)) == before  # the groups were not disturbed: nothing moved
    lab.kill(0)  # rank 0 serves the store: its replacement serves a new one
    after = shown(lab.run_cell("import os\n" + ENVIRONMENT))
    # The rendezvous moved to the new world's store; every rank agrees where.
    assert len({env["MASTER_PORT"] for env in after}) == 1
    assert after[0]["MASTER_PORT"] != before[0]["MASTER_PORT"]
    assert [env["RANK"] for env in after] == ["0", "1", "2", "3"]


def test_every_rank_has_its_own_random_state_until_seeded(lab):
    draws = shown(lab.run_cell("import random, numpy\n(torch.initial_seed(), random.random(), float(numpy.random.rand()))"))
    for position in range(3):
        assert len({draw[position] for draw in draws}) == 4, "ranks forked from one host must not share a random state"
    assert lab.seed(7) == [7, 8, 9, 10]
    first = shown(lab.run_cell("(torch.rand(1).item(), random.random(), float(numpy.random.rand()))"))
    lab.seed(7)
    assert shown(lab.run_cell("(torch.rand(1).item(), random.random(), float(numpy.random.rand()))")) == first
    assert len({draw[0] for draw in first}) == 4  # seed + rank: different on every rank
    assert lab.seed(7, same=True) == [7] * 4
    for absurd in (-1, 2**64, 1.5, True):
        with pytest.raises(LabConfigError, match="a seed is an integer"):
            lab.seed(absurd)
    assert len(set(lab.run_cell("torch.rand(1).item()"))) == 1


def test_a_replaced_rank_draws_a_fresh_random_state(lab):
    lab.seed(3, same=True)
    os.kill(lab.status().ranks[2].pid, signal.SIGKILL)
    time.sleep(0.5)
    lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)")  # the dead rank is replaced first, then it runs
    seeds = lab.run_cell("torch.initial_seed()")
    assert seeds[2] != seeds[0] and seeds[0] == seeds[1] == seeds[3] == "3"


STALE_CELL = '''
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
torch.manual_seed(0)
tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
embedding = parallelize_module(torch.nn.Embedding(8, 4), tp_mesh, RowwiseParallel())
round(float(embedding(torch.arange(4).view(1, 4)).sum().detach()), 5)
'''


def test_no_state_of_an_old_process_group_survives_a_rebuild(lab):
    first = lab.run_cell(STALE_CELL, timeout=20)
    with pytest.raises(RankFailure):
        lab.run_cell("raise ValueError('an ordinary mistake')")
    # Before the fix, DTensor reused sharding plans naming the old groups: ranks failed to
    # resolve them, or waited on the wrong group until the limit.
    assert lab.run_cell("extra = dist.new_group([0, 1, 2, 3])\n" + STALE_CELL, timeout=20) == first


def test_seed_magic():
    shell = ipython_shell()
    shell.run_line_magic("load_ext", "labkit")
    try:
        shell.run_line_magic("lab", "start 2 --backend gloo --threads 1")
        shell.run_line_magic("lab", "seed 5 --same")
        assert shell.user_ns["lab"].run_cell("torch.initial_seed()") == ["5", "5"]
        from IPython.core.error import UsageError

        with pytest.raises(UsageError, match="one seed"):
            shell.run_line_magic("lab", "seed minus-one")
    finally:
        shell.run_line_magic("lab", "stop")
        shell.run_line_magic("unload_ext", "labkit")


def test_init_destroy_and_exit_in_cells(lab, capsys):
    lab.run_cell("dist.init_process_group('gloo')\ndist.destroy_process_group()")
    said = capsys.readouterr().out
    assert "the lab's process group is already in place" in said and "keeps its process group" in said
    assert lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == ["4.0"] * 4  # still there
    lab.run_cell("print('before')\nexit()\nprint('after exit(): must not run')")
    said = capsys.readouterr().out
    assert said.count("before") == 4 and "must not run" not in said
    with pytest.raises(RankFailure, match="rank 3 raised ScriptExit: exited with code 2"):
        lab.run_cell("import sys\nif rank == 3:\n    sys.exit(2)")
    with pytest.raises(RankFailure, match="this lab's ranks run gloo"):
        lab.run_cell("dist.init_process_group('nccl')")


def test_notebook_functions_show_their_source_and_missing_imports_say_why(lab):
    import linecache

    # What IPython does with a notebook cell: code under a made-up file name, its lines in linecache.
    cell = "def main():\n    total = 1\n    raise ValueError('deep inside main')\n"
    filename = "<ipython-input-7-0123456789ab>"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(cell, filename, "exec"), namespace)
    with pytest.raises(RankFailure) as caught:
        lab.run(namespace["main"])
    assert "raise ValueError('deep inside main')" in caught.value.details()
    with pytest.raises(RankFailure) as caught:
        lab.run_cell("numpy_alias.zeros(3)")
    assert "NameError: name 'numpy_alias' is not defined" in str(caught.value)
    assert "import inside the function, or run the import in a %%lab cell" in caught.value.details()
