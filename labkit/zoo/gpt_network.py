"""The zoo's tiny GPT-style decoder network, and how it splits over tensor, pipeline and FSDP ranks.

The blocks sit in an ``nn.ModuleDict`` keyed "0", "1", ... so that a pipeline
stage can drop the blocks it does not own and every parameter keeps its name
(``blocks.2.attn.q.weight`` is the same tensor on one machine and on stage 1 of
2): that is what lets a distributed run be compared, parameter by parameter,
with single-process training.

Shapes are written so tensor parallelism can shard them: attention infers its
local head count from the width of its (possibly column-sharded) projections.
The plan (``TinyGPT.tp_plan``) is Megatron's: q/k/v column-wise, so each rank
owns some heads, and the output projection row-wise; in the feed-forward, up
column-wise and down row-wise. ``GPTConfig.check_tp`` refuses head counts and
widths the plan cannot divide. Each block is an FSDP unit of its own. The
model's declaration (settings, data, loss) is ``labkit.zoo.gpt``; this module
is what the ranks build, with torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from labkit.zoo.stages import stage_slice

if TYPE_CHECKING:  # the settings class only names a type here: its module imports this one on the ranks
    from labkit.zoo.gpt import GPTConfig


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(projection: torch.Tensor) -> torch.Tensor:
            # -1: under tensor parallelism a rank holds only its share of the heads.
            return projection.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.down = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only language model: embed, blocks, final norm, head to logits.

    On a pipeline stage that is not first, ``embed`` is None and the input is the
    previous stage's hidden states; on a stage that is not last, ``norm`` and
    ``head`` are None and the output is hidden states.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # None on a pipeline stage that does not hold them (keep_stage).
        self.embed: Embedding | None = Embedding(config)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.dim)
        self.head: nn.Linear | None = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def keep_stage(self, stage: int, stages: int) -> None:
        """Keep pipeline ``stage``'s blocks; the embedding only on the first, norm and head only on the last."""
        for name in stage_slice(list(self.blocks), stage, stages, invert=True):
            del self.blocks[name]
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.norm = None
            self.head = None

    def fsdp_units(self) -> list[nn.Module]:
        """Every block this stage holds: FSDP gathers one block's parameters at a time."""
        return list(self.blocks.values())

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Megatron's pairs in every block this stage holds; with ``sequence_parallel``, norms sharded by sequence.

        Sequence parallelism also splits what the column/row pairs leave whole:
        the LayerNorms and the residual stream are sharded along the sequence,
        and the pairs' all-reduce becomes a reduce-scatter into sequence shards
        plus an all-gather before the next attention or feed-forward.
        """
        # Under sequence parallelism the row-wise layers hand the residual stream back as sequence shards.
        residual = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        for name in self.blocks:
            block = f"blocks.{name}"
            plan.update(
                {
                    f"{block}.attn.q": ColwiseParallel(),
                    f"{block}.attn.k": ColwiseParallel(),
                    f"{block}.attn.v": ColwiseParallel(),
                    f"{block}.attn.out": RowwiseParallel(output_layouts=residual),
                    f"{block}.mlp.up": ColwiseParallel(),
                    f"{block}.mlp.down": RowwiseParallel(output_layouts=residual),
                }
            )
            if sequence_parallel:
                # Norms work on sequence shards; attention and MLP need the whole sequence.
                whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan.update(
                    {
                        f"{block}.attn_norm": SequenceParallel(),
                        f"{block}.mlp_norm": SequenceParallel(),
                        f"{block}.attn": whole,
                        f"{block}.mlp": whole,
                    }
                )
        if sequence_parallel:
            if self.embed is not None:
                plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
            if self.norm is not None:
                plan["norm"] = SequenceParallel()
                # The head stays whole on every rank; it gets the whole sequence as a plain tensor.
                plan["head"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
        return plan
