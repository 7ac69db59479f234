"""The per-rank memory budget's verdict and refusal message: pure, no ranks.

Estimates are the dicts ``wire.entry.estimate_memory`` returns, made by hand so
every byte in the message can be predicted.
"""

import pytest

from labkit.runs.budget import MemoryBudgetError, check_budget
from labkit.spec.errors import LabError
from labkit.spec.train_config import resolve
from labkit.wire.schema import total_bytes

BUDGET = 1_000_000  # "1MB": SI megabyte
DDP_SENTENCE = "adding ranks never makes it fit"
NO_FIT_ADVICE = "Split the model itself (fsdp, tp or pp), over more ranks, or use a smaller model."


def config(strategy="ddp", **settings):
    return resolve(4, strategy=strategy, model="mlp", max_memory="1MB", **settings)


def memory(params, grads, optimizer):
    return {"params": params, "grads": grads, "optimizer": optimizer}


def under_budget(total=400_000):
    return memory(total // 4, total // 4, total // 2)


# Rank 2 has the largest total (1.2 MB); rank 0 has the largest params (and grads) but a smaller
# total (1.1 MB), so a worst rank picked by any single field, or by the first rank over budget,
# is the wrong one. The mean over ranks (0.65 MB) is under the budget.
WORST_IS_RANK_2 = [
    memory(550_000, 550_000, 0),
    under_budget(),
    memory(300_000, 250_000, 650_000),
    under_budget(),
]


def refusal(cfg, estimates, alternatives) -> str:
    with pytest.raises(MemoryBudgetError) as caught:
        check_budget(cfg, estimates, alternatives)
    return str(caught.value)


# -- total_bytes -------------------------------------------------------------------


def test_total_bytes_adds_params_grads_and_optimizer_state():
    assert total_bytes(memory(1, 20, 300)) == 321
    assert total_bytes(memory(0, 0, 0)) == 0


def test_total_bytes_counts_only_the_three_budgeted_parts():
    # Anything else a rank reports (activations are not budgeted) stays out of the total.
    assert total_bytes({"params": 5, "grads": 5, "optimizer": 10, "activations": 1000}) == 20


def test_total_bytes_needs_every_part():
    with pytest.raises(KeyError):
        total_bytes({"params": 5, "grads": 5})


# -- the verdict -------------------------------------------------------------------


def test_the_budget_is_one_megabyte_in_si_units():
    assert config().max_memory == BUDGET


def test_ranks_that_fit_pass_without_asking_for_alternatives():
    # Alternatives that would not parse as sizes prove they are never looked at.
    assert check_budget(config(), [under_budget()] * 4, {"fsdp": None}) is None


def test_exactly_the_budget_fits_and_one_byte_more_does_not():
    at_budget = memory(250_000, 250_000, 500_000)
    assert check_budget(config(), [under_budget(), at_budget, under_budget(), under_budget()], {}) is None
    over = memory(250_000, 250_000, 500_001)
    message = refusal(config(), [under_budget(), over, under_budget(), under_budget()], {})
    assert "on rank 1 " in message


def test_one_rank_over_the_budget_is_enough_to_refuse():
    estimates = [under_budget(100_000)] * 4
    estimates = estimates[:3] + [memory(400_000, 400_000, 400_000)]
    message = refusal(config(), estimates, {})
    assert "needs 1.2 MB on rank 3 " in message


def test_the_refusal_is_a_lab_error():
    with pytest.raises(LabError):
        check_budget(config(), WORST_IS_RANK_2, {})


# -- the refusal message --------------------------------------------------------------


def test_refusal_names_the_worst_rank_and_its_byte_breakdown():
    message = refusal(config("fsdp"), WORST_IS_RANK_2, {})
    first = message.splitlines()[0]
    assert first == (
        "mlp under fsdp needs 1.2 MB on rank 2 "
        "(params 300.0 kB + grads 250.0 kB + adamw state 650.0 kB), over the budget of 1.0 MB per rank."
    )
    assert "rank 0" not in message and "550.0 kB" not in message


def test_refusal_names_the_optimizer_whose_state_it_counts():
    message = refusal(config("ddp", optimizer="sgd"), [memory(600_000, 600_000, 0)] * 4, {})
    assert "+ sgd state 0 B)" in message
    assert "adamw" not in message


def test_pure_ddp_is_told_that_more_ranks_never_help():
    message = refusal(config("ddp"), WORST_IS_RANK_2, {"fsdp": 400_000})
    assert DDP_SENTENCE in message
    assert "whole copy of the model, its gradients and optimizer state on every rank" in message
    # The sentence comes after the size line and before the alternatives.
    lines = message.splitlines()
    assert DDP_SENTENCE in lines[1] and lines[2].startswith("Per rank under sharding strategies")


def test_sharding_strategies_are_not_told_that_more_ranks_never_help():
    assert DDP_SENTENCE not in refusal(config("fsdp"), WORST_IS_RANK_2, {"tp": 400_000})


def test_ddp_composed_with_model_parallelism_is_not_pure_ddp():
    composed = config("ddp+pp")  # mesh pp=2 x dp=2: the mlp's 4 layers split into 2 stages
    assert composed.dp_kind == "ddp"  # the ddp part is there, but it is not alone
    message = refusal(composed, WORST_IS_RANK_2, {})
    assert DDP_SENTENCE not in message
    assert message.startswith("mlp under ddp+pp needs 1.2 MB on rank 2 ")


def test_alternatives_are_listed_in_order_with_those_that_fit_marked():
    alternatives = {"fsdp": 1_500_000, "tp": 999_999, "pp": 1_000_000}
    message = refusal(config(), WORST_IS_RANK_2, alternatives)
    assert (
        "Per rank under sharding strategies on these 4 ranks: "
        "fsdp 1.5 MB, tp 1000.0 kB (fits), pp 1.0 MB (fits)." in message
    )
    assert message.count("(fits)") == 2


def test_the_suggestion_is_the_first_alternative_that_fits_not_the_smallest():
    alternatives = {"fsdp": 1_100_000, "tp": 900_000, "pp": 300_000}
    message = refusal(config(), WORST_IS_RANK_2, alternatives)
    assert message.splitlines()[-1] == "Use strategy='tp' (or another that fits) to split the model itself."
    assert "strategy='pp'" not in message and "strategy='fsdp'" not in message
    assert NO_FIT_ADVICE not in message


def test_an_alternative_exactly_at_the_budget_is_suggested():
    message = refusal(config(), WORST_IS_RANK_2, {"fsdp": 1_000_001, "pp": 1_000_000})
    assert "pp 1.0 MB (fits)" in message and "fsdp 1.0 MB," in message  # fsdp is over by a byte
    assert "Use strategy='pp'" in message


def test_when_no_alternative_fits_the_advice_is_to_split_the_model():
    message = refusal(config(), WORST_IS_RANK_2, {"fsdp": 1_100_000, "tp": 2_000_000, "pp": 1_000_001})
    assert "(fits)" not in message and "strategy=" not in message
    assert "fsdp 1.1 MB, tp 2.0 MB, pp 1.0 MB." in message
    assert message.splitlines()[-1] == NO_FIT_ADVICE


def test_without_alternatives_there_is_no_list_only_the_advice():
    message = refusal(config("fsdp"), WORST_IS_RANK_2, {})
    assert "Per rank under sharding strategies" not in message
    assert message.splitlines() == [message.splitlines()[0], NO_FIT_ADVICE]


def test_the_rank_count_is_the_number_of_estimates():
    two = resolve(2, strategy="ddp", model="mlp", max_memory="1MB")
    message = refusal(two, [under_budget(), memory(600_000, 600_000, 0)], {"fsdp": 600_000})
    assert "on these 2 ranks" in message and "on rank 1 " in message
