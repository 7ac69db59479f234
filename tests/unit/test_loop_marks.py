"""labkit.log and labkit.step outside a watched lab rank: nothing happens, and a bad count is refused alike."""

import pytest
import torch

import labkit


def test_outside_a_watched_rank_they_do_nothing():
    labkit.log(loss=1.5, accuracy=0.5)
    with labkit.step(samples=8, tokens=64):
        ran = True
    assert ran


@pytest.mark.parametrize("given", [dict(samples=-1), dict(samples=2.5), dict(tokens=True), dict(samples="8")])
def test_a_count_that_is_not_a_whole_number_is_refused_with_an_example(given):
    with pytest.raises(ValueError, match=r"whole number, 0 or more, e.g. labkit.step\("):
        with labkit.step(**given):
            pass


@pytest.mark.parametrize("given, shown", [
    (dict(loss="x"), "loss='x'"), (dict(loss=None), "loss=None"), (dict(accuracy=True), "accuracy=True"),
    (dict(loss=torch.ones(1000)), r"loss=a Tensor of shape \(1000,\)"),
])
def test_a_value_that_is_not_one_number_is_refused_naming_labkit_log_and_the_key(given, shown):
    # Checked under torchrun too (no lab here), so a script fails alike in and out of the lab.
    with pytest.raises(ValueError, match=rf"labkit.log\({shown}\): each value is one number.*e.g. labkit.log\("):
        labkit.log(**given)


def test_numbers_and_one_element_tensors_are_accepted():
    labkit.log(loss=torch.tensor(0.5), step_loss=torch.ones(1), lr=1e-3, tokens=10, nan=float("nan"))


@pytest.mark.parametrize("given, bound", [(dict(samples=10**30), "1,000,000,000 samples"),
                                          (dict(tokens=10**13), "1,000,000,000,000 tokens")])
def test_an_absurd_count_is_refused_with_the_bound_and_an_example(given, bound):
    with pytest.raises(ValueError, match=rf"more than {bound} in one step on one rank.*e.g. labkit.step\("):
        with labkit.step(**given):
            pass
