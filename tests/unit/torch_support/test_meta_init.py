"""Which networks the ranks build on the meta device, and what filling a split one gives it (one process)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.torch_support.meta_init import fill_from_rank0
from labkit.torch_support.trainable import OwnTrainable, initial_network, seeded_build


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.register_buffer("count", torch.arange(4.0))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) @ self.mask
        return x


class Staged(Stack):
    def keep_stage(self, stage, stages):
        pass


def on_meta(network: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in [*network.parameters(), *network.buffers()])


def trainable(factory, options=None, meta=True) -> OwnTrainable:
    return OwnTrainable("Stack", factory, lambda step, generator: torch.zeros(2, 4), None, 3, options or {},
                        meta=meta)


def test_a_sharding_strategy_builds_on_meta_unless_a_tracer_or_the_model_needs_values():
    assert trainable(Stack).builds_on_meta(("fsdp",)) and trainable(Stack).builds_on_meta(("tp", "fsdp"))
    assert not trainable(Stack, meta=False).builds_on_meta(("fsdp",))  # its constructor failed on meta
    assert not trainable(Stack).builds_on_meta(("pp",))  # cut by tracing: the tracer runs the model
    assert trainable(Staged).builds_on_meta(("ddp", "pp"))  # its own keep_stage cuts it on meta
    assert not trainable(Staged, {"pp_split": ["blocks.1"]}).builds_on_meta(("pp",))


def test_the_initial_network_is_built_on_the_cpu_whatever_the_device():
    made = trainable(Stack)
    network = initial_network(made, 3, "cpu")
    again = seeded_build(Stack, 3, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(network.state_dict().values(), again.state_dict().values()))
    assert on_meta(initial_network(made, 3, "meta")) and not on_meta(network)


@pytest.fixture
def one_process_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_network_split_on_meta_takes_every_value_of_rank_0s_whole_build(one_process_group):
    network = seeded_build(Stack, 3, "meta")
    whole = seeded_build(Stack, 3, "cpu")
    fill_from_rank0(network, whole, torch.device("cpu"), torch.device("cpu"))
    assert not on_meta(network)
    assert all(torch.equal(a, b) for a, b in zip(network.state_dict().values(), whole.state_dict().values()))
    assert torch.equal(network.mask, whole.mask)  # a buffer the state dict does not carry


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_stay_one_parameter(one_process_group):
    network = seeded_build(Tied, 3, "meta")
    fill_from_rank0(network, seeded_build(Tied, 3, "cpu"), torch.device("cpu"), torch.device("cpu"))
    assert network.head.weight is network.embed.weight and len(list(network.parameters())) == 1


def test_a_tensor_the_whole_build_lacks_is_refused_not_left_empty(one_process_group):
    network = seeded_build(Stack, 3, "meta")
    network.register_buffer("extra", torch.zeros(2, device="meta"), persistent=False)
    with pytest.raises(RuntimeError, match="extra"):
        fill_from_rank0(network, seeded_build(Stack, 3, "cpu"), torch.device("cpu"), torch.device("cpu"))
