"""Zoo models own their splits: they offer the Model protocol, plans name real submodules, configs refuse
what cannot split."""

import pytest
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from labkit.zoo.catalog import model
from labkit.zoo.configs import GPTConfig, MLPConfig, model_config
from labkit.zoo.model_protocol import ChecksStages, ChecksTensorParallel, Model
from labkit.zoo.models import build_model

ZOO = ("gpt", "mlp")


def plan_targets(model, sequence_parallel):
    return set(model.tp_plan(sequence_parallel))


@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_model_offers_the_whole_protocol(name):
    network = build_model(name, model_config(name), 0, "meta")
    offered: Model = network  # the type checker's view; the isinstance checks are the strategies'
    assert isinstance(offered, Model)
    assert isinstance(model_config(name), ChecksStages) and isinstance(model_config(name), ChecksTensorParallel)
    units = network.fsdp_units()
    assert len(units) == model_config(name).layers  # one FSDP unit per block or layer
    assert all(any(unit is child for child in network.modules()) for unit in units)


def test_a_declaration_builds_the_same_weights_for_the_same_seed_and_refuses_unknown_settings():
    declared = model("mlp")
    settings = declared.settings_for({"dims": [8, 16, 4]})  # a list, as JSON gives it, becomes a tuple
    assert settings == MLPConfig(dims=(8, 16, 4))
    first, second = declared.build(settings, 5), declared.build(settings, 5)
    assert all((a == b).all() for a, b in zip(first.parameters(), second.parameters()))
    with pytest.raises(ValueError, match="model 'mlp' has no setting width; its settings are dims"):
        declared.settings_for({"width": 3})


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_tp_plan_names_real_submodules(name, sequence_parallel):
    # On the meta device: shapes and names only, no memory and no weights.
    model = build_model(name, model_config(name), 0, "meta")
    submodules = {module_name for module_name, _ in model.named_modules()}
    plan = plan_targets(model, sequence_parallel)
    assert plan, f"{name} has an empty tensor-parallel plan"
    assert plan <= submodules, f"{name}'s plan names no such submodule: {sorted(plan - submodules)}"


@pytest.mark.parametrize("name", ZOO)
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
    # What it accepted, the plan can shard: every width a column-wise layer splits (its outputs) and a
    # row-wise layer splits (its inputs) divides by tp.
    network = build_model(config.name, config, 0, "meta")
    split = []
    for name, style in network.tp_plan(sequence_parallel).items():
        layer = network.get_submodule(name)
        if isinstance(layer, nn.Linear) and isinstance(style, ColwiseParallel):
            split.append(layer.out_features)
        elif isinstance(layer, nn.Linear) and isinstance(style, RowwiseParallel):
            split.append(layer.in_features)
    assert split and all(width % tp == 0 for width in split), split


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


def test_what_a_model_does_not_offer_is_refused_saying_what_to_add_or_falls_back():
    from labkit.strategies.fsdp import units_of
    from labkit.strategies.pp import keep_stage
    from labkit.strategies.tp import apply_tp

    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))  # offers none of the protocol's parts
    with pytest.raises(TypeError, match="no tensor-parallel plan for Sequential: give it a tp_plan"):
        apply_tp(plain, tp_mesh=None)
    with pytest.raises(TypeError, match="no pipeline stages for Sequential: give it a keep_stage"):
        keep_stage(plain, pp_mesh=None)
    assert units_of(plain) == []  # FSDP shards it as one unit
    gpt = build_model("gpt", GPTConfig(layers=2), 0, "meta")
    assert units_of(gpt) == list(gpt.blocks.values())
    assert units_of(plain, plan=gpt) == list(gpt.blocks.values())  # what speaks for a model is asked instead
