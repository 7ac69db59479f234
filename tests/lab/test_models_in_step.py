"""Issue 36: a failed cell never costs a model, whatever iteration state the model was in; a
KeyboardInterrupt a cell raises is told as raised.

Real ranks (3, so the two that go on are not the one that failed), real gloo groups. Each model (DDP
plain and static-graph, FSDP2; never trained, one step, three) is built in a cell; one rank fails
before, in, between, during or after forward and backward while the others run theirs; then the model
trains on and ends bitwise equal to the same model trained without that cell. An FSDP run of
``lab.train`` whose loss raised on one rank resumes (``resume=True``) as one run without the failure. A
Ctrl-C of a cell's DDP loop stops every rank at the same step, and training goes on as without it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from labkit.spec.errors import RankFailure, RankInterrupted
from tests import model_step_cells as cells
from tests.conftest import started_lab
from tests.model_step_cells import BUILD, FAILURES, VARIANTS


@pytest.fixture(scope="module")
def lab():
    with started_lab(3, timeout=60) as lab:
        lab.run_cell(BUILD)
        yield lab


def _value(lab, name):
    return lab.run(lambda: __import__("IPython").get_ipython().user_ns[name])


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_model_trains_on_after_a_cell_that_failed_on_one_rank(lab, failure):
    for variant in VARIANTS:
        lab.run_cell(f"variant = {variant!r}\nmodel, optimizer = build(variant)")
        with pytest.raises(RankFailure) as raised:
            lab.run_cell(FAILURES[failure])
        assert 1 in raised.value.causes, (variant, str(raised.value))
        steps = variant[1]
        lab.run_cell(f"for step in range({steps}, {steps + 2}):\n    train(model, optimizer, step)")
        lab.run_cell(f"same = same_as_without_failure(model, variant, {steps + 2})")
        assert _value(lab, "same") == [True] * 3, (failure, variant)


def test_a_keyboard_interrupt_a_cell_raises_itself_is_told_as_raised_not_as_a_limit_reached(lab):
    with pytest.raises(RankFailure) as raised:
        lab.run_cell("if rank == 2:\n    raise KeyboardInterrupt")
    said = str(raised.value).splitlines()[0]
    assert said.startswith("rank 2 raised KeyboardInterrupt: raised by the work itself"), said
    assert "did not finish" not in said and "skipped a collective" not in said, said
    assert "not disturbed" in raised.value.recovery


def test_an_fsdp_run_whose_loss_raised_on_one_rank_resumes_as_one_run_without_the_failure(lab):
    own = dict(model=cells.small_net, data=cells.classes, log_every=100)
    lab.train("fsdp", steps=20, loss=cells.cross_entropy, **own)
    uninterrupted = lab.model_state()
    with pytest.raises(RankFailure, match="rank 1 raised ValueError: the loss failed at its sixth call"):
        lab.train("fsdp", steps=20, loss=cells.cross_entropy_failing_once, **own)
    lab.train(steps=15, resume=True)
    resumed = lab.model_state()
    assert all(torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted)


@pytest.mark.parametrize("after", [0.4, 0.9, 1.3])
def test_ctrl_c_stops_a_ddp_loop_at_the_same_step_on_every_rank(lab, after):
    lab.run_cell("variant = ('ddp', 0)\nmodel, optimizer = build(variant)\nsteps_done = 0")
    threading.Timer(after, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    with pytest.raises(RankInterrupted) as interrupted:
        lab.run_cell(cells.LOOP)
    assert time.monotonic() - began < after + 5, str(interrupted.value)
    assert "StopBeforeIteration" in str(interrupted.value.reports), "every rank was signalled: none stopped between steps"
    steps = _value(lab, "steps_done")
    assert len(set(steps)) == 1 and steps[0] > 0, steps  # every rank applied the same optimizer steps
    lab.run_cell("for _ in range(2):\n    train(model, optimizer, steps_done)\n    steps_done += 1\n"
                 "same = same_as_without_failure(model, variant, steps_done)")
    assert _value(lab, "same") == [True] * 3
