"""Issue 18: what cells build on the process groups survives the cells that fail after them.

Real ranks, real gloo groups: a DDP module, an FSDP2 model, a tensor-parallel module on a
mesh of the cell's own and a group of the cell's own are built once, then cells fail in
each way a notebook user makes them fail (a typo on every rank, one rank raising while the
other waits in a collective, a backward or an FSDP all-gather cut short, a cell interrupted
at its time limit while a peer waits), and training goes on, ending bitwise equal to a run
in which nothing failed. A rank that is replaced costs those objects, and using them then
fails at once, saying why.
"""

from __future__ import annotations

import time

import pytest

from labkit.spec.errors import RankFailure, RankTimeout
from tests.conftest import started_lab
from tests.survivor_cells import BUILD, COMPARE, FAILURES, TIMEOUTS


@pytest.fixture(scope="module")
def lab():
    with started_lab(2, timeout=60) as lab:
        lab.run_cell(BUILD)
        yield lab


def _same_as_without_failures(lab) -> bool:
    lab.run_cell(COMPARE)
    return lab.run(lambda: __import__("IPython").get_ipython().user_ns["same"]) == [True] * lab.world_size


def test_every_kind_of_failure_leaves_the_models_training_bitwise_as_without_it(lab):
    lab.run_cell("models, optimizers, group = build()\nSTEPS = 0")
    generation = lab.generation
    for what, code, cuts in FAILURES:
        lab.run_cell("train(models, optimizers, group, STEPS); STEPS += 1")
        started = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            lab.run_cell(code)
        took = time.monotonic() - started
        if cuts:
            assert lab.generation == generation + 1, what
            assert "rebuilt in place" in failure.value.recovery, what
            assert took < 10, f"{what}: {took:.1f} s"
        else:
            assert lab.generation == generation, what
            assert "not disturbed" in failure.value.recovery, what
            assert "rebuilt" not in str(failure.value), what
        generation = lab.generation
        assert lab.run(lambda: 1) == [1, 1]
    lab.run_cell("for _ in range(2):\n    train(models, optimizers, group, STEPS); STEPS += 1")
    assert _same_as_without_failures(lab)


def test_a_cell_stopped_at_its_limit_while_a_peer_waits_keeps_the_models(lab):
    lab.run_cell("models, optimizers, group = build()\nSTEPS = 0\ntrain(models, optimizers, group, STEPS); STEPS += 1")
    for what, code, cuts, limit in TIMEOUTS:
        generation = lab.generation
        with pytest.raises(RankTimeout):
            lab.run_cell(code, timeout=limit)
        assert lab.generation == generation + (1 if cuts else 0), what
    lab.run_cell("train(models, optimizers, group, STEPS); STEPS += 1")
    assert _same_as_without_failures(lab)


def test_a_replaced_rank_makes_the_old_objects_fail_at_once_saying_why(lab, capsys):
    lab.run_cell("models, optimizers, group = build()\ntrain(models, optimizers, group, 0)")
    lab.kill(1)
    time.sleep(0.5)
    capsys.readouterr()
    lab.run_cell("print('healed')")  # replaces rank 1 first, and names what can no longer be used
    note = capsys.readouterr().out
    assert "on rank 0: group (process group), models (list holding DistributedDataParallel, " in note, note
    assert "Sequential with DTensor parameters" in note and "optimizers (list holding SGD of DTensor" in note
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        lab.run_cell("dist.all_reduce(torch.ones(1), group=group)", ranks=0)
    assert time.monotonic() - started < 5
    error = failure.value.reports[0]["error"]
    assert error["type"] == "StaleGroupError"
    assert "rank 1 was replaced" in error["message"] and "re-create" in error["message"]
    lab.run_cell(BUILD)  # the remedy the message gives works
    lab.run_cell("models, optimizers, group = build()\ntrain(models, optimizers, group, 0)")
