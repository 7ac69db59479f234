"""A training run continues in the next cell: ``lab.train(..., resume=True)`` (real ranks).

The ranks keep each run's ``TrainState`` (model, optimizer, step, data position,
random state); a continuation must end exactly where one run of all the steps
ends, and must refuse what would not be the same run.
"""

import pytest
import torch

from labkit import LabConfigError, RankFailure
from labkit.wire.entry import this_rank

pytestmark = pytest.mark.lab


def full_parameters():
    """This rank's parameters gathered whole, by name (DTensors gathered, stage-local under pp)."""
    from torch.distributed.tensor import DTensor

    state = this_rank().train_state
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for name, p in state.parallel.named_parameters()}, state.step


def _equal(first, second) -> bool:
    return all(first[name].shape == second[name].shape and torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(
    "strategy, model, mesh, settings",
    [
        ("ddp", "mlp", None, dict(optimizer="adamw")),
        ("fsdp+tp", "gpt", dict(dp=2, tp=2), dict(global_batch=16)),
        ("pp", "mlp", None, dict(schedule="gpipe", micro_batches=4)),
    ],
    ids=["ddp-mlp", "fsdp+tp-gpt", "pp-mlp"],
)
def test_a_continued_run_ends_exactly_where_one_long_run_ends(lab, strategy, model, mesh, settings):
    whole = lab.train(strategy, model, steps=5, mesh=mesh, log_every=100, **settings)
    one_run = lab.run(full_parameters)
    lab.train(strategy, model, steps=2, mesh=mesh, log_every=100, **settings)
    second = lab.train(steps=3, resume=True, log_every=100)
    continued = lab.run(full_parameters)
    assert second.config.first_step == 2 and second.steps_done == 3
    assert [step for _, step in continued] == [5] * lab.world_size
    for (expected, _), (got, _) in zip(one_run, continued):
        assert _equal(expected, got), "a continuation must end with the parameters of one run of all the steps"
    assert second.losses == whole.losses[2:]  # the same batches, in the same order


def test_a_continuation_carries_the_settings_and_may_verify_all_steps(lab):
    lab.train("ddp", "mlp", steps=3, lr=3e-3, log_every=100)
    report = lab.train(steps=2, resume=True, verify=True, log_every=100)
    assert report.config.lr == 3e-3 and report.config.strategy == "ddp"
    assert report.equivalent, str(report)  # against 5 single-process steps
    assert "continuing the last run from step 3" in str(report)


def test_a_continuation_with_other_settings_is_refused_before_any_rank_works(lab):
    lab.train("ddp", "mlp", steps=2, log_every=100)
    with pytest.raises(LabConfigError, match="lr was 0.001, now 0.5"):
        lab.train(steps=2, resume=True, lr=0.5)
    with pytest.raises(LabConfigError, match="strategy was 'ddp', now 'fsdp'"):
        lab.train("fsdp", steps=2, resume=True)
    lab.train(steps=1, resume=True, log_every=100)  # the refusals left the state as it was


def test_failed_cells_leave_the_run_resumable_ending_where_one_run_ends(lab):
    whole = lab.train("ddp", "mlp", steps=5, log_every=100)
    one_run = lab.run(full_parameters)
    lab.train("ddp", "mlp", steps=2, log_every=100)
    generation = lab.generation
    with pytest.raises(RankFailure):
        lab.run(lambda: 1 / 0)  # every rank raised, no collective was cut: the groups are kept
    assert lab.generation == generation
    with pytest.raises(RankFailure):  # rank 0 waits in an all-reduce rank 1 never joins: rebuilt in place
        lab.run_cell("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('only here')\ndist.all_reduce(x)")
    assert lab.generation == generation + 1
    second = lab.train(steps=3, resume=True, log_every=100)
    continued = lab.run(full_parameters)
    assert [step for _, step in continued] == [5] * lab.world_size
    for (expected, _), (got, _) in zip(one_run, continued):
        assert _equal(expected, got), "a continuation after failed cells must end where one run ends"
    assert second.losses == whole.losses[2:]


def test_nothing_to_resume_after_a_rank_is_replaced(lab):
    lab.train("ddp", "mlp", steps=2, log_every=100)
    lab.kill(1)
    lab.run(lambda: 1)  # the lab replaces rank 1 first: the ranks form a new world
    with pytest.raises(LabConfigError, match="no training run to resume"):
        lab.train(steps=2, resume=True)
    assert lab.run(lambda: this_rank().train_state) == [None] * lab.world_size
