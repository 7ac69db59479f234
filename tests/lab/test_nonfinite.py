"""Losses that are NaN or infinite, and losses of the wrong kind, on 2 real gloo ranks.

Step 4's batch holds a NaN in rank 1's share only (``tests.nonfinite_model``): every rank must act at that
step together, or one would be left waiting in a collective."""

import math

import pytest
import torch

from labkit.spec.errors import RankFailure
from labkit.views.nonfinite_report import NonFiniteLoss
from tests import nonfinite_model as tiny
from tests.conftest import started_lab

pytestmark = pytest.mark.lab

OWN = dict(model=tiny.Tiny, loss=tiny.mse, global_batch=8, log_every=100)


@pytest.fixture(scope="module")
def lab():
    with started_lab(2, timeout=60) as running:
        yield running


def finite(state) -> bool:
    return all(bool(torch.isfinite(value).all()) for value in state.values())


@pytest.mark.parametrize("strategy, split", [("ddp", {}), ("fsdp", {}), ("pp", dict(pp_split=["layers.1"]))])
def test_stop_ends_every_rank_at_the_step_in_one_line_and_keeps_the_last_finite_model(lab, strategy, split):
    # Under pp rank 1, the last stage, computes the loss: it is that rank's loss that is NaN there too.
    with pytest.raises(NonFiniteLoss) as stopped:
        lab.train(strategy, data=tiny.make_batch, steps=6, **split, **OWN)
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith("the loss was nan on rank 1 at step 4: training stopped there on every rank, before that "
                           "step's update (last finite loss ")
    assert stopped.value.report.steps_done == 3
    kept = lab.model_state()
    assert finite(kept)
    # Nothing lost, nothing half applied: the model is bitwise what three steps make.
    lab.train(strategy, data=tiny.make_batch, steps=3, **split, **OWN)
    assert all(torch.equal(kept[name], value) for name, value in lab.model_state().items())
    # And the run goes on from there, past the bad batch, when asked to skip it.
    going_on = lab.train(steps=3, resume=True, on_nonfinite="skip")
    assert going_on.config.first_step == 3 and going_on.steps_done == 3 and finite(lab.model_state())


def test_skip_drops_that_steps_update_on_every_rank_and_goes_on(lab, capsys):
    report = lab.train("ddp", data=tiny.make_batch, steps=6, on_nonfinite="skip", verify=True, **OWN)
    assert report.steps_done == 6 and math.isnan(report.losses[3])
    assert all(math.isfinite(loss) for step, loss in enumerate(report.losses) if step != 3)
    assert finite(lab.model_state())
    said = capsys.readouterr().out
    assert "labkit: skipped the update of 1 step whose loss was not finite: step 4 (first: nan on rank 1)" in said
    # The single-process reference trains on the NaN batch: it is that side that is said not finite.
    assert report.equivalent is False
    assert ("NOT compared, no difference can be measured: this run's parameters are all finite; 4 of the "
            "single-process reference's hold NaN or infinity") in str(report)


def test_continue_trains_on_warns_once_and_verify_never_says_equal(lab, capsys):
    report = lab.train("ddp", data=tiny.make_batch, steps=6, on_nonfinite="continue", verify=True, **OWN)
    assert report.steps_done == 6 and math.isnan(report.losses[-1]) and not finite(lab.model_state())
    said = capsys.readouterr().out
    assert said.count("labkit: warning: the loss was not finite in 3 steps (4, 5, 6; first: nan on rank 1 at "
                      "step 4), and training went on (on_nonfinite='continue')") == 1
    assert report.equivalent is False and "equal within" not in str(report)
    assert "NOT compared, no difference can be measured: 4 of this run's parameters hold NaN or infinity" in str(report)


@pytest.mark.parametrize("loss, said", [
    (tiny.squared_errors, "your loss function (squared_errors) returned a tensor of shape (4, 1), not a scalar: "
                          "return one number for the batch, e.g. its mean (loss.mean())"),
    (tiny.as_float, "your loss function (as_float) returned a float, not a tensor: return a scalar tensor"),
])
def test_a_loss_of_the_wrong_kind_is_named_with_what_to_return(lab, loss, said):
    with pytest.raises(RankFailure) as failed:
        lab.train("ddp", model=tiny.Tiny, data=tiny.all_finite, loss=loss, steps=2, global_batch=8)
    assert str(failed.value).splitlines()[0].startswith("ranks 0, 1 raised TypeError: " + said)
