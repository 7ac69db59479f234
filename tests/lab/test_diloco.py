"""DiLoCo on 4 real gloo ranks: proven against its one-process simulation, cheap on the wire, continued exactly.

Replicas drift apart between outer steps, so ``verify`` compares every rank with
its own replica in DiLoCo's single-process simulation
(``labkit.strategies.diloco.reference_parameters``). The pure parts (settings,
the outer step's arithmetic, the simulation itself) are in ``tests/unit/strategies/test_diloco.py``.
"""

import pytest
import torch

from labkit import LabConfigError
from labkit.wire.entry import this_rank

pytestmark = pytest.mark.lab

MLP = dict(dims=(16, 64, 64, 64, 16))
GPT = dict(dim=32, heads=4, layers=4, seq=16, vocab=32)
QUIET = dict(global_batch=16, log_every=100)
HONEST = {}  # on each rank: the real average, while a test breaks it


def full_parameters():
    """This rank's parameters gathered whole, by name, and the state's step."""
    from torch.distributed.tensor import DTensor

    state = this_rank().train_state
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for name, p in state.parallel.named_parameters()}, state.step


def global_copy():
    """DiLoCo's global copy on this rank, gathered whole, by name."""
    from torch.distributed.tensor import DTensor

    outer = this_rank().train_state.parallel.extra_state["diloco"]
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
            for name, value in outer.global_parameters().items()}


def sum_instead_of_average(broken: bool) -> None:
    """On the ranks: sum the pseudo-gradients over the replicas without dividing (a real error), or undo it."""
    import torch.distributed as dist

    from labkit.strategies import diloco_outer

    HONEST.setdefault("average", diloco_outer.average_over_replicas)
    diloco_outer.average_over_replicas = (lambda flat, group, size: dist.all_reduce(flat, group=group)) if broken \
        else HONEST["average"]


def _largest_difference(first: dict, second: dict) -> float:
    return max(float((first[name] - second[name]).norm() / second[name].norm()) for name in second)


def _same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


def test_one_inner_sgd_step_and_a_plain_outer_step_ends_where_ddp_ends(lab):
    settings = dict(steps=3, model_settings=MLP, optimizer="sgd", lr=0.05, verify=True, **QUIET)
    ddp = lab.train("ddp", "mlp", **settings)
    by_ddp = lab.run(full_parameters)
    report = lab.train("diloco", "mlp", inner_steps=1, outer_lr=1, outer_momentum=0, **settings)
    by_diloco = lab.run(full_parameters)
    assert ddp.equivalent and report.equivalent, str(report)
    for (ours, _), (theirs, _) in zip(by_diloco, by_ddp):
        assert _largest_difference(ours, theirs) < 1e-6  # one SGD step on the averaged gradient, rounded otherwise
    assert report.verify["model_moved"] > 1e-3


def test_one_inner_adamw_step_is_the_average_of_the_replicas_updates(lab):
    report = lab.train("diloco", "gpt", steps=3, model_settings=GPT, inner_steps=1, outer_lr=1, outer_momentum=0,
                       verify=True, **QUIET)
    assert report.equivalent, str(report)
    assert report.verify["model_moved"] > 1e-3


def test_three_inner_steps_verify_and_a_broken_average_does_not(lab):
    settings = dict(steps=4, model_settings=GPT, inner_steps=3, verify=True, **QUIET)  # ends mid-round
    report = lab.train("diloco", "gpt", **settings)
    assert report.equivalent, str(report)
    assert report.max_relative_difference < 1e-5 and report.verify["model_moved"] > 1e-3
    lab.run(sum_instead_of_average, True)
    try:
        broken = lab.train("diloco", "gpt", **settings)
    finally:
        lab.run(sum_instead_of_average, False)
    assert not broken.equivalent and broken.max_relative_difference > 100 * broken.equivalence_bound, str(broken)


def test_diloco_around_fsdp_replicas_trains_and_verifies(lab):
    report = lab.train("diloco+fsdp", "gpt", steps=5, mesh=dict(replica=2, dp=2), model_settings=GPT, inner_steps=2,
                       verify=True, **QUIET)
    assert report.equivalent, str(report)
    assert report.verify["model_moved"] > 1e-3
    assert [result["coordinate"] for result in report.results][:2] == [{"replica": 0, "dp": 0},
                                                                        {"replica": 0, "dp": 1}]


def _all_reduced(report) -> list[int]:
    return [sum(row["bytes"].get("all_reduce", 0) for row in result["rows"]) for result in report.results]


def test_it_all_reduces_a_fifth_of_ddps_bytes_with_five_inner_steps(lab):
    ddp = _all_reduced(lab.train("ddp", "mlp", steps=10, model_settings=MLP, **QUIET))
    diloco = _all_reduced(lab.train("diloco", "mlp", steps=10, model_settings=MLP, inner_steps=5, **QUIET))
    for ours, theirs in zip(diloco, ddp):
        assert ours / theirs == pytest.approx(1 / 5, rel=0.01), (diloco, ddp)


def test_a_continuation_and_a_reloaded_checkpoint_end_where_one_run_ends(lab, tmp_path):
    settings = dict(mesh=dict(replica=2, dp=2), model_settings=MLP, inner_steps=3, **QUIET)
    lab.train("diloco+fsdp", "mlp", steps=7, **settings)
    one_run = lab.run(full_parameters)
    lab.train("diloco+fsdp", "mlp", steps=4, **settings)  # stops mid-round: the replicas differ
    path = lab.save(str(tmp_path / "mid-round"))
    agreed = lab.run(global_copy)
    lab.train(steps=3, resume=True, log_every=100)
    assert all(_same(expected, got) for (expected, _), (got, _) in zip(one_run, lab.run(full_parameters)))
    lab.load(path)
    report = lab.train(steps=3, resume=True, log_every=100, verify=True)
    assert report.equivalent, str(report)  # all 7 steps against the simulation
    assert all(_same(expected, got) and step == 7
               for (expected, _), (got, step) in zip(one_run, lab.run(full_parameters)))
    # With another number of replicas (diloco alone: 4), or under another strategy, every rank starts from the
    # checkpoint's model, the global copy.
    for strategy in ("diloco", "ddp"):
        lab.load(path, strategy=strategy)
        assert all(_same(agreed[0], got) and step == 4 for got, step in lab.run(full_parameters)), strategy
    # A checkpoint without DiLoCo's state (saved under ddp): the loaded model becomes the global copy.
    lab.load(lab.save(str(tmp_path / "ddp")), strategy="diloco")
    assert all(_same(agreed[0], got) for got in lab.run(global_copy))


def test_bad_settings_are_refused_before_any_rank_works(lab):
    lab.train("diloco", "mlp", steps=1, model_settings=MLP, **QUIET)
    for settings, message in [
        (dict(inner_steps=0), r"inner_steps \(diloco\) is a positive integer, got 0"),
        (dict(outer_momentum=1), r"outer_momentum \(diloco\) must be below 1, got 1"),
        (dict(outer_lr=-1), r"outer_lr \(diloco\) is a positive number, got -1"),
    ]:
        with pytest.raises(LabConfigError, match=message):
            lab.train("diloco", "mlp", steps=1, **settings)
    with pytest.raises(LabConfigError, match="inner_steps is a setting of diloco"):
        lab.train("ddp", "mlp", steps=1, inner_steps=5)
    assert [step for _, step in lab.run(full_parameters)] == [1] * lab.world_size  # the ranks' state untouched


def test_memory_counts_the_global_copy_and_its_momentum(lab):
    from labkit import MemoryBudgetError

    ddp = lab.train("ddp", "mlp", steps=1, log_every=100)
    diloco = lab.train("diloco", "mlp", steps=1, log_every=100)
    params = ddp.memory[0]["params"]
    for alone, replica in zip(ddp.memory, diloco.memory):
        assert replica["params"] == alone["params"] == params
        assert replica["optimizer"] == alone["optimizer"] + 2 * params  # AdamW's two moments, plus DiLoCo's two
    budget = 5 * params  # DDP needs 4 copies (weights, gradients, two moments), DiLoCo 6
    assert lab.train("ddp", "mlp", steps=1, log_every=100, max_memory=budget).steps_done == 1
    with pytest.raises(MemoryBudgetError):
        lab.train("diloco", "mlp", steps=1, log_every=100, max_memory=budget)


def _local_parameters():
    from labkit.wire.entry import this_rank as rank_runtime

    state = rank_runtime().train_state
    return {name: p.detach().clone() for name, p in state.parallel.named_parameters()}, state.step


def test_a_rank_killed_mid_run_is_healed_from_a_checkpoint_taken_mid_round(lab, tmp_path):
    import time

    settings = dict(steps=24, inner_steps=4, log_every=1000)
    lab.train("diloco", "mlp", **settings)
    uninterrupted = lab.run(_local_parameters)
    lab.slow(2, 0.05)  # ~70 ms a step: the kill lands mid-run
    try:
        run = lab.train("diloco", "mlp", checkpoint_every=6, checkpoint_dir=str(tmp_path), auto_heal=True,
                        background=True, **settings)  # step 6 is mid-round: replicas differ there
        deadline = time.monotonic() + 60
        while not (tmp_path / "step-00000006" / "labkit.json").exists() and time.monotonic() < deadline:
            assert not run.done, run.status()
            time.sleep(0.05)
        time.sleep(0.2)
        lab.kill(1)
        report = run.wait(120)
    finally:
        lab.slow(2, None)
    assert len(report.notes) == 1 and "rank 1 died" in report.notes[0]
    healed = lab.run(_local_parameters)
    for (before, _), (after, step) in zip(uninterrupted, healed):
        assert step == 24 and before.keys() == after.keys()
        assert all(torch.equal(before[name], after[name]) for name in before)
