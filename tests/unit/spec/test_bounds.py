"""Absurd values refused in the notebook with their bound and an example: pure, no ranks."""

import pytest

from labkit.runs.ensemble import member_specs
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import resolve
from labkit.zoo.configs import model_config


@pytest.mark.parametrize("lr", [1e308, 10.5, float("inf"), float("nan"), 0, -1e-3, True, "fast"])
def test_a_learning_rate_is_above_zero_and_at_most_ten(lr):
    with pytest.raises(ValueError, match=r"lr is a learning rate above 0 and at most 10 \(past that training "
                                         r"diverges at once\), got .*; e.g. lr=1e-3"):
        resolve(2, lr=lr)
    assert resolve(2, lr=10).lr == 10.0


@pytest.mark.parametrize("setting, most", [("steps", "10,000,000"), ("global_batch", "1,048,576"),
                                           ("micro_batches", "1,024")])
def test_counts_past_any_run_are_refused_with_their_bound(setting, most):
    with pytest.raises(ValueError, match=rf"{setting} is a whole number from 1 to {most}, got 1000000000000"):
        resolve(2, **{setting: 10**12})


def specs(**changed):
    arguments = dict(model="gpt", members=4, steps=5, vary="seed", lr=3e-3, seed=0, global_batch=32,
                     heldout_batches=2, optimizer="adamw", model_settings={}, ranks=2)
    return member_specs(**{**arguments, **changed})


def test_ensemble_members_are_bounded_by_the_ranks_and_a_spread_of_rates_by_its_width():
    assert len(specs(members=128)) == 128  # 64 per rank
    with pytest.raises(LabConfigError, match=r"members is a whole number from 1 to 128, got 100000; e.g. members=4 "
                                             r"\(at most 64 per rank: 128 on 2 ranks\)"):
        specs(members=100_000)
    # 3000 members under vary="lr" raised a raw OverflowError (2 ** 1500): refused before the spread is computed.
    with pytest.raises(LabConfigError, match=r"members is a whole number from 1 to 16, got 100; e.g. members=5 "
                                             r"with vary='lr'"):
        specs(members=100, vary="lr", ranks=100)
    with pytest.raises(LabConfigError, match=r"the largest of 16 members' learning rates is lr x 181.019 = 543.058, above "
                                             r"10: give a smaller lr \(at most 0.0552\) or fewer members"):
        specs(members=16, vary="lr", lr=3.0)
    assert max(spec["lr"] for spec in specs(members=16, vary="lr", lr=0.05)) <= 10
    with pytest.raises(LabConfigError, match=r"steps is a whole number from 1 to 10,000,000"):
        specs(steps=10**12)


@pytest.mark.parametrize("model, settings, said", [
    ("mlp", dict(dims="abc"), "model 'mlp': setting dims is a tuple of whole numbers, got 'abc'; "
                              "e.g. dims=(128, 512, 512, 512, 128)"),
    ("mlp", dict(dims=(16, "x", 16)), "setting dims is a tuple of whole numbers, got (16, 'x', 16)"),
    ("mlp", dict(dims=(16, 0, 16)), "model 'mlp': setting dims is a size, each at least 1, got (16, 0, 16)"),
    ("gpt", dict(dim="abc"), "model 'gpt': setting dim is a whole number, got 'abc'; e.g. dim=64"),
    ("gpt", dict(dim=64.0), "setting dim is a whole number, got 64.0"),
    ("gpt", dict(layers=True), "setting layers is a whole number, got True"),
    ("gpt", dict(heads=-4), "model 'gpt': setting heads is a size, each at least 1, got -4; e.g. heads=4"),
])
def test_a_model_setting_of_the_wrong_kind_is_named_with_its_kind_and_default(model, settings, said):
    # dims=abc reached torch on every rank ("randn() received an invalid combination of arguments").
    with pytest.raises(ValueError) as refused:
        model_config(model, **settings)
    assert said in str(refused.value)
    with pytest.raises(ValueError, match="setting"):
        resolve(2, model=model, model_settings=settings)


def test_settings_of_the_right_kind_still_resize_the_model():
    assert model_config("mlp", dims=[16, 32, 16]).dims == (16, 32, 16)  # a list (JSON, a magic) stands for a tuple
    assert model_config("gpt", dim=32, heads=2).head_dim == 16
