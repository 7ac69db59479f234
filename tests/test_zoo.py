"""Zoo models own their splits: plans name real submodules, configs refuse what cannot split."""

import pytest

from labkit.zoo.configs import GPTConfig, MLPConfig, model_config
from labkit.zoo.models import MODEL_CLASSES, build_model


def plan_targets(model, sequence_parallel):
    return set(model.tp_plan(sequence_parallel))


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_tp_plan_names_real_submodules(name, sequence_parallel):
    # On the meta device: shapes and names only, no memory and no weights.
    model = build_model(name, model_config(name), 0, "meta")
    submodules = {module_name for module_name, _ in model.named_modules()}
    plan = plan_targets(model, sequence_parallel)
    assert plan, f"{name} has an empty tensor-parallel plan"
    assert plan <= submodules, f"{name}'s plan names no such submodule: {sorted(plan - submodules)}"


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_a_pipeline_stage_plans_only_the_layers_it_keeps(name):
    for stage in range(2):
        model = build_model(name, model_config(name), 0, "meta")
        model.keep_stage(stage, 2)
        submodules = {module_name for module_name, _ in model.named_modules()}
        for sequence_parallel in (False, True):
            assert plan_targets(model, sequence_parallel) <= submodules


def test_the_gpt_plan_shards_norms_only_under_sequence_parallelism():
    model = build_model("gpt", GPTConfig(layers=2), 0, "meta")
    assert "blocks.0.attn.q" in plan_targets(model, False)
    assert not {"norm", "blocks.0.attn_norm"} & plan_targets(model, False)
    assert {"norm", "blocks.0.attn_norm", "blocks.1.mlp_norm"} <= plan_targets(model, True)


def test_the_mlp_plan_pairs_layers_and_leaves_an_odd_last_one_whole():
    model = build_model("mlp", MLPConfig(dims=(8, 16, 16, 4)), 0, "meta")
    assert plan_targets(model, False) == {"layers.0", "layers.1"}


@pytest.mark.parametrize(
    "config, tp, sequence_parallel, message",
    [
        (GPTConfig(heads=3, dim=48), 2, False, "tp=2 must divide the number of attention heads (3)"),
        (GPTConfig(heads=4), 8, False, "tp=8 must divide the number of attention heads (4)"),
        # Reachable only when heads do not divide dim: the width check still stands guard.
        (GPTConfig(dim=6, heads=4, mlp_ratio=1), 4, False, "tp=4 must divide the MLP width (6)"),
        (GPTConfig(seq=30), 4, True, "sequence parallelism needs tp=4 to divide the sequence length (30)"),
        (
            MLPConfig(dims=(8, 6, 16, 10, 4)),
            4,
            False,
            "tp=4 must divide the widths it splits; [6, 10] do not (MLP dims (8, 6, 16, 10, 4))",
        ),
        (MLPConfig(), 2, True, "sequence parallelism applies to the GPT model (its norms and residual stream)"),
    ],
)
def test_check_tp_refuses_splits_that_do_not_divide(config, tp, sequence_parallel, message):
    with pytest.raises(ValueError) as refused:
        config.check_tp(tp, sequence_parallel)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "config, tp, sequence_parallel",
    [
        (GPTConfig(), 1, False),
        (GPTConfig(), 4, True),
        (GPTConfig(heads=8, dim=64, seq=32), 8, True),
        (MLPConfig(), 4, False),
        # Only widths a pair splits count: 6 sits between layers 1 and 2, which no pair shares.
        (MLPConfig(dims=(8, 16, 6, 16, 3)), 4, False),
    ],
)
def test_check_tp_accepts_splits_that_divide(config, tp, sequence_parallel):
    config.check_tp(tp, sequence_parallel)


@pytest.mark.parametrize(
    "config, pp, message",
    [
        (MLPConfig(dims=(8, 16, 4)), 3, "pp=3 stages need at least 3 layers; mlp has 2"),
        (GPTConfig(layers=4), 8, "pp=8 stages need at least 8 layers; gpt has 4"),
    ],
)
def test_check_stages_refuses_more_stages_than_layers(config, pp, message):
    with pytest.raises(ValueError) as refused:
        config.check_stages(pp)
    assert str(refused.value) == message


@pytest.mark.parametrize("config, pp", [(MLPConfig(dims=(8, 16, 4)), 2), (GPTConfig(layers=4), 4), (GPTConfig(), 1)])
def test_check_stages_accepts_a_stage_per_layer_or_fewer(config, pp):
    config.check_stages(pp)
    # What it accepted can be cut so: every stage keeps at least one of the model's layers.
    name = "mlp" if isinstance(config, MLPConfig) else "gpt"
    for stage in range(pp):
        model = build_model(name, config, seed=0)
        model.keep_stage(stage, pp)
        kept = model.layers if name == "mlp" else model.blocks
        assert len(kept) >= 1, (stage, pp)


def test_tp_checks_the_pairs_each_pipeline_stage_makes():
    # 5 layers over 2 stages: stage 1 holds layers 3 and 4 and pairs them, splitting width 5,
    # which the whole model's pairs (0,1) and (2,3) never split.
    from labkit.spec.train_config import resolve

    dims = (8, 8, 8, 8, 5, 8)
    assert resolve(2, strategy="tp", model="mlp", model_settings=dict(dims=dims)).axis("tp") == 2
    MLPConfig(dims=dims).check_tp(2, False)
    with pytest.raises(ValueError, match=r"tp=2 must divide the widths it splits; \[5\]"):
        MLPConfig(dims=dims).check_tp(2, False, stages=2)
    with pytest.raises(ValueError, match=r"\[5\] do not"):
        resolve(4, strategy="pp+tp", model="mlp", mesh=dict(pp=2, tp=2), model_settings=dict(dims=dims))
