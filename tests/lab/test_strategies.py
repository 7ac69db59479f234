"""Every strategy and composition on 4 real gloo ranks ends where one process would.

Each case trains a few steps with ``verify``: every rank retrains the model in
plain single-process PyTorch on the same global batches and compares every
parameter, gathered whole, with its own.
"""

import math

import pytest

from labkit.runs.budget import MemoryBudgetError

pytestmark = pytest.mark.lab

SMALL_GPT = dict(dim=32, heads=4, layers=4, seq=16, vocab=32)
SMALL_MLP = dict(dims=(16, 64, 64, 64, 16))

CASES = [
    # strategy, model, mesh, extra settings
    ("ddp", "mlp", None, dict(micro_batches=2, bucket_cap_mb=0.01)),  # accumulation, several buckets
    ("fsdp", "gpt", None, dict(optimizer="sgd", lr=0.1)),  # SGD: a summed gradient would show at once
    ("fsdp", "mlp", None, dict(reshard_after_forward=False)),
    ("tp", "mlp", None, {}),
    ("tp", "gpt", None, dict(sequence_parallel=True)),
    ("pp", "gpt", None, dict(schedule="gpipe", micro_batches=4)),
    ("pp", "mlp", None, dict(schedule="1f1b", micro_batches=4)),
    ("fsdp+tp", "gpt", dict(dp=2, tp=2), {}),
    ("ddp+tp", "gpt", dict(dp=2, tp=2), {}),
    ("ddp+pp", "gpt", dict(dp=2, pp=2), dict(micro_batches=2)),
    ("fsdp+pp", "mlp", dict(dp=2, pp=2), dict(micro_batches=2)),
    ("pp+tp", "gpt", dict(pp=2, tp=2), dict(micro_batches=2, schedule="gpipe")),
]


def _settings(model):
    return SMALL_GPT if model == "gpt" else SMALL_MLP


@pytest.mark.parametrize("strategy, model, mesh, extra", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_equals_single_process_training(lab, strategy, model, mesh, extra):
    report = lab.train(
        strategy, model, steps=3, mesh=mesh, global_batch=16, verify=True,
        model_settings=_settings(model), log_every=100, **extra,
    )
    assert report.max_relative_difference < report.equivalence_bound, str(report)
    assert report.equivalence_bound <= 1e-4, "rounding noise this large would hide real errors"
    assert report.verify["model_moved"] > 1e-3, "training must move the model, or equality proves nothing"
    assert all(math.isfinite(loss) for loss in report.losses)
    assert report.equivalent


def test_sharding_divides_memory_per_rank(lab):
    def per_rank(strategy, **extra):
        report = lab.train(strategy, "gpt", steps=1, global_batch=16, model_settings=SMALL_GPT, **extra)
        return max(m["params"] for m in report.memory), report

    ddp, ddp_report = per_rank("ddp")
    fsdp, fsdp_report = per_rank("fsdp")
    tp, _ = per_rank("tp")
    pp, _ = per_rank("pp", micro_batches=4)
    assert fsdp <= ddp / 4 * 1.05  # 1/W of every parameter (padding aside)
    assert tp < ddp and pp < ddp
    # AdamW keeps two states per parameter (plus a scalar step count); gradients match parameters.
    for memory in ddp_report.memory + fsdp_report.memory:
        assert memory["grads"] == memory["params"]
        assert 2 * memory["params"] <= memory["optimizer"] <= 2.01 * memory["params"]


def test_memory_budget_refuses_data_parallel_and_names_the_way_out(lab):
    bigger = dict(SMALL_GPT, dim=128, layers=4, vocab=64)
    with pytest.raises(MemoryBudgetError) as caught:
        lab.train("ddp", "gpt", steps=1, global_batch=16, model_settings=bigger, max_memory="6MB")
    message = str(caught.value)
    assert "over the budget of 6.0 MB" in message
    assert "adding ranks never makes it fit" in message
    assert "fsdp" in message and "(fits)" in message
    report = lab.train("fsdp", "gpt", steps=1, global_batch=16, model_settings=bigger, max_memory="6MB")
    assert report.max_memory_bytes <= 6_000_000
    assert "(within)" in str(report)


def test_losses_fall_when_training_longer(lab):
    report = lab.train("fsdp+tp", "gpt", steps=12, mesh=dict(dp=2, tp=2), global_batch=16,
                       model_settings=SMALL_GPT, lr=3e-3, log_every=100)
    assert report.losses[-1] < report.losses[0] - 0.3
    assert report.samples_per_second > 0 and report.tokens_per_second == report.samples_per_second * 16
