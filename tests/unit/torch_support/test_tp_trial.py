"""Tensor-parallel plans tried on the meta device: which fit together, and the one a refusal suggests
(``torch_support.tp_trial``). No ranks: one rank's slice of the network is run on shapes only."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.zoo.own_checks import PLAN_IN_WORDS
from labkit.torch_support.tp_trial import Untried, example_text, plan_failure, suggested_plan


class Gated(nn.Module):
    """SwiGLU-like: ``gate`` runs beside ``up`` on the block's input, not after it; defined before ``gate``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.gate = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, fixed_heads: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.heads, self.head_dim, self.fixed_heads = heads, dim // heads, fixed_heads

    def forward(self, x):
        batch, seq, _ = x.shape
        heads = self.heads if self.fixed_heads else -1  # a count written in: no rank's slice has every head
        q, k, v = (layer(x).view(batch, seq, heads, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(mixed.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, dim: int, fixed_heads: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, 4, fixed_heads)
        self.mlp = Gated(dim)

    def forward(self, x):
        return self.mlp(self.attn(self.norm(x)))


class Tower(nn.Module):
    def __init__(self, block=Gated, dim: int = 16, depth: int = 2, **options) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(block(dim, **options) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x):
        return self.blocks[0](x) if x.sum().item() > 0 else x  # the meta device has no values


def on_meta(**options) -> nn.Module:
    with torch.device("meta"):
        return Tower(**options)


ROWS = (torch.randn(4, 8), torch.randn(4, 3))
SEQUENCES = (torch.randn(2, 5, 8), torch.randn(2, 5, 3))


def test_a_gated_block_is_suggested_gate_and_up_colwise_then_down_rowwise():
    plan = suggested_plan(on_meta(), ROWS, 2)
    assert plan == {"blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    assert plan_failure(on_meta(), ROWS, plan, 2) is None


def test_the_plan_once_suggested_for_a_gated_block_fails_on_the_meta_device_naming_the_shapes():
    failure = plan_failure(on_meta(), ROWS, {"blocks.*.up": "colwise", "blocks.*.gate": "rowwise"}, 2)
    assert failure is not None and failure.startswith("RuntimeError: ") and "[4, 16]" in failure


def test_attention_and_a_gated_feed_forward_are_both_split():
    plan = suggested_plan(on_meta(block=Block), SEQUENCES, 4)
    assert plan == {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                    "blocks.*.attn.o": "rowwise", "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise",
                    "blocks.*.mlp.down": "rowwise"}


def test_attention_with_its_head_count_written_in_is_left_whole():
    plan = suggested_plan(on_meta(block=Block, fixed_heads=True), SEQUENCES, 2)
    assert plan == {"blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}


def test_what_cannot_be_tried_suggests_the_rule_in_words():
    with torch.device("meta"):
        model = DataDependent()
    assert suggested_plan(model, ROWS[:1], 2) is None
    assert example_text(model, ROWS[:1], 2) == PLAN_IN_WORDS
    assert example_text(on_meta(), None, 2) == PLAN_IN_WORDS  # data made on the ranks: nothing to try it on
    with pytest.raises(Untried):
        plan_failure(model, ROWS[:1], {"blocks.0": "colwise"}, 2)
    with pytest.raises(Untried):
        plan_failure(on_meta(), ROWS, {"blocks.*.norm": "sequence"}, 2)


def test_the_suggestion_is_written_as_the_user_passes_it():
    assert example_text(on_meta(), ROWS, 2) == ('{"blocks.*.gate": "colwise", "blocks.*.up": "colwise", '
                                                '"blocks.*.down": "rowwise"}')
