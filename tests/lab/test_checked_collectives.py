"""A lab started with ``check_collectives=True`` (torch's collective checker on every group): every model
torch offers and every strategy of ``lab.train`` runs under it, and a collective only some ranks call is
named as fast as without it, no rank replaced (real ranks, 4, tiny models, two steps each).
"""

import time

import pytest

from labkit import Lab, RankFailure

from tests.conftest import stop_leaving_nothing

pytestmark = pytest.mark.lab

SMALL_MLP = dict(dims=(16, 32, 32, 32, 16))  # 4 layers: a stage each for pp on 4 ranks
SMALL_GPT = dict(dim=32, heads=4, layers=2, seq=16, vocab=32)


@pytest.fixture(scope="module")
def checked():
    lab = Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=30, interrupt_grace=3,
              check_collectives=True).start()
    try:
        yield lab
    finally:
        stop_leaving_nothing(lab)


MODELS_BUILT_IN_A_CELL = {
    "ddp": "from torch.nn.parallel import DistributedDataParallel\n"
           "model = DistributedDataParallel(torch.nn.Linear(4, 4))",
    "fsdp2": "from torch.distributed.fsdp import fully_shard\n"
             "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))\n"
             "fully_shard(model)",
    "tp": "from torch.distributed.device_mesh import init_device_mesh\n"
          "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
          "model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)),\n"
          "                           init_device_mesh('cpu', (world_size,)), {'0': ColwiseParallel(), '1': RowwiseParallel()})",
}


@pytest.mark.parametrize("kind", list(MODELS_BUILT_IN_A_CELL))
def test_a_model_built_in_a_cell_trains_under_checked_collectives(checked, kind):
    # DDP's constructor read the checker as if it were gloo and crashed every rank (SIGSEGV).
    code = MODELS_BUILT_IN_A_CELL[kind] + "\nmodel(torch.ones(2, 4)).sum().backward()\n'trained'"
    assert checked.run_cell(code) == ["'trained'"] * 4


STRATEGIES = [
    ("ddp", "mlp", None, {}),
    ("fsdp", "mlp", None, {}),
    ("tp", "mlp", None, {}),
    ("pp", "mlp", None, dict(micro_batches=4)),
    ("ps", "mlp", None, {}),
    ("diloco", "mlp", None, {}),
    ("fsdp+tp", "gpt", dict(dp=2, tp=2), {}),
]


@pytest.mark.parametrize("strategy, model, mesh, extra", STRATEGIES, ids=[case[0] for case in STRATEGIES])
def test_every_strategy_trains_under_checked_collectives(checked, strategy, model, mesh, extra):
    pids = dict(checked.cluster.pid_of)
    report = checked.train(strategy, model, steps=2, global_batch=12, mesh=mesh, log_every=100,
                           model_settings=SMALL_GPT if model == "gpt" else SMALL_MLP, **extra)
    assert report.steps_done == 2
    assert dict(checked.cluster.pid_of) == pids  # no rank crashed and was replaced


def test_a_lone_collective_is_named_at_once_and_no_rank_is_replaced(checked):
    checked.run_cell("kept = 10 + rank")
    pids = dict(checked.cluster.pid_of)
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"deadlock: rank 0 waits in all_reduce on the world group .* which "
                                          r"ranks 1, 2, 3 will never join; rank 0 failed in a collective as a "
                                          r"consequence of ranks 1, 2, 3"):
        checked.run_cell("if rank == 0:\n    dist.all_reduce(torch.ones(4))", timeout=20)
    # torch's checker holds rank 0 before the collective: named there, not at the limit (20 s, then a
    # replacement of the rank that could not be interrupted).
    assert time.monotonic() - began < 8
    assert dict(checked.cluster.pid_of) == pids
    assert checked.run_cell("kept") == ["10", "11", "12", "13"]
    assert checked.run_cell("dist.all_reduce(torch.ones(3)); 1") == ["1"] * 4  # and it works again
