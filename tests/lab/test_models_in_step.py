"""Issue 36: a failed cell never costs a model, whatever iteration state the model was in; a
KeyboardInterrupt a cell raises is told as raised.

Real ranks (3, so the two that go on are not the one that failed), real gloo groups. Each model (DDP
plain and static-graph, FSDP2; never trained, one step, three) is built in a cell; one rank fails
before, in, between, during or after forward and backward while the others run theirs; then the model
trains on and ends bitwise equal to the same model trained without that cell.
"""

from __future__ import annotations

import pytest

from labkit.spec.errors import RankFailure
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
