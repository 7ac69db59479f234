"""DiLoCo's pure parts, no processes: its settings, its outer step's arithmetic, its one-process reference."""

import pytest
import torch

from labkit.magics.train_args import train_parser
from labkit.rank import verify
from labkit.spec.train_config import resolve
from labkit.strategies import diloco, diloco_outer
from labkit.strategies.catalog import compositions

MLP = dict(dims=(16, 64, 64, 16))


def test_settings_defaults_meshes_and_magic_options():
    config = resolve(4, strategy="diloco", model="gpt")
    assert config.options == {"inner_steps": 10, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert config.mesh.describe() == "replica=4" and config.data_parts == 4
    assert resolve(4, strategy="diloco+fsdp", model="gpt").mesh.describe() == "replica=2 x dp=2"
    given = resolve(4, strategy="fsdp+diloco", mesh=dict(replica=2, dp=2), global_batch=8)
    assert given.data_parts == 4 and given.mesh_names == ("replica", "dp")
    assert {"diloco", "ddp+diloco", "fsdp+diloco", "diloco+pp", "diloco+tp"} <= set(compositions(4))
    parsed = vars(train_parser().parse_args(
        ["--strategy", "diloco", "--inner-steps", "5", "--outer-lr", "0.5", "--outer-momentum", "0"]))
    assert parsed == {"strategy": "diloco", "inner_steps": 5, "outer_lr": 0.5, "outer_momentum": 0.0}
    plain = resolve(4, strategy="diloco", outer_momentum=0)
    assert plain.setting(diloco.OUTER_MOMENTUM) == 0 == plain.setting("outer_momentum")  # plain outer SGD is allowed


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(strategy="diloco", inner_steps=0), r"inner_steps \(diloco\) is a positive integer, got 0"),
        (dict(strategy="diloco", inner_steps=2.5), r"inner_steps \(diloco\) is a positive integer"),
        (dict(strategy="diloco", outer_momentum=1), r"outer_momentum \(diloco\) must be below 1, got 1"),
        (dict(strategy="diloco", outer_momentum=-0.1), r"outer_momentum \(diloco\) is at least 0"),
        (dict(strategy="diloco", outer_lr=-1), r"outer_lr \(diloco\) is a positive number, got -1"),
        (dict(strategy="diloco", outer_lr=float("nan")), r"outer_lr \(diloco\) is a finite number"),
        (dict(strategy="ddp", inner_steps=5), "inner_steps is a setting of diloco"),
        (dict(strategy="diloco", global_batch=30), "split evenly into 4 data-parallel replicas"),
        (dict(strategy="diloco+ddp", mesh=dict(dp=2, tp=2)), "uses mesh axes replica, dp"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        resolve(4, **settings)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_the_outer_step_is_torchs_sgd_bit_for_bit(momentum):
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    ours = [value.clone() for value in start]
    buffers = [torch.zeros_like(value) for value in start]
    theirs = [value.clone().requires_grad_() for value in start]
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=False)
    for _ in range(4):
        gradients = [torch.randn_like(value) for value in start]
        diloco_outer.outer_update(ours, gradients, buffers, 0.7, momentum)
        for parameter, gradient in zip(theirs, gradients):
            parameter.grad = gradient.clone()
        sgd.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(ours, theirs))


def _largest_difference(first: dict, second: dict) -> float:
    return max(verify.relative_difference(first[name], second[name]) for name in second)


def test_one_inner_sgd_step_and_a_plain_outer_step_is_synchronous_sgd():
    config = resolve(4, strategy="diloco", model="mlp", model_settings=MLP, global_batch=16, optimizer="sgd",
                     lr=0.05, inner_steps=1, outer_lr=1, outer_momentum=0)
    initial, simulated = diloco.reference_parameters(config, "cpu", 3)
    _, one_process = verify.reference_parameters(config, "cpu", 3)
    assert _largest_difference(simulated, one_process) < 1e-6  # the same mathematics, rounded otherwise
    assert _largest_difference(initial, one_process) > 1e-3


def test_one_inner_adamw_step_averages_the_replicas_updates():
    config = resolve(4, strategy="diloco", model="mlp", model_settings=MLP, global_batch=16, lr=0.01,
                     inner_steps=1, outer_lr=1, outer_momentum=0)
    _, simulated = diloco.reference_parameters(config, "cpu", 3)
    # Written out: four replicas, each its own AdamW on a quarter of the batch, parameters averaged every step.
    from labkit.torch_support.optimizers import make_optimizer
    from labkit.zoo.data import dataset_for, loss_function
    from labkit.zoo.models import build_model  # the names people import from the zoo still work

    models = [build_model("mlp", config.model_config, 0) for _ in range(4)]
    optimizers = [make_optimizer(model.parameters(), config) for model in models]
    data, loss_fn = dataset_for("mlp", config.model_config, 0), loss_function("mlp")
    for step in range(3):
        inputs, targets = data.batch(step, 16)
        for model, optimizer, x, y in zip(models, optimizers, inputs.chunk(4), targets.chunk(4)):
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        with torch.no_grad():
            for group in zip(*(model.parameters() for model in models)):
                mean = torch.stack(group).mean(0)
                for parameter in group:
                    parameter.copy_(mean)
    averaged = {name: p.detach() for name, p in models[0].named_parameters()}
    assert _largest_difference(simulated, averaged) < 1e-6
    _, plain = verify.reference_parameters(config, "cpu", 3)
    assert _largest_difference(simulated, plain) > 1e-4  # AdamW's average update is not AdamW on the average


def test_between_outer_steps_each_replica_has_its_own_parameters():
    config = resolve(4, strategy="diloco", model="mlp", model_settings=MLP, global_batch=16, inner_steps=3)
    at_round_end = [diloco.reference_parameters(config, "cpu", 3, data_share=(index, 4))[1] for index in (0, 3)]
    assert _largest_difference(*at_round_end) == 0.0  # every replica starts the next round from the global copy
    mid_round = [diloco.reference_parameters(config, "cpu", 4, data_share=(index, 4))[1] for index in (0, 3)]
    assert _largest_difference(*mid_round) > 1e-4
    # Under diloco+fsdp (replica=2 x dp=2) ranks 0, 1 are replica 0: data shares 0 and 1 of 4.
    nested = resolve(4, strategy="diloco+fsdp", model="mlp", model_settings=MLP, global_batch=16, inner_steps=3)
    first, second = (diloco.reference_parameters(nested, "cpu", 4, data_share=(index, 4))[1] for index in (0, 1))
    assert _largest_difference(first, second) == 0.0
    noisy = diloco.reference_parameters(nested, "cpu", 4, chunks=4, data_share=(0, 4))[1]
    assert 0 < _largest_difference(noisy, first) < 1e-5  # the rounding-noise reference: another order, same sums
