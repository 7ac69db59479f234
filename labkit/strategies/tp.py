"""Tensor parallelism with DTensor's ``parallelize_module``: one layer split over ranks.

The classic pairing (Megatron): a column-wise linear layer splits its output
features, so each rank computes its slice of the activations with no
communication; the following row-wise layer splits its input features, so each
rank computes a partial sum, and one all-reduce makes the output whole. In the
GPT block that is q/k/v column-wise (each rank owns some attention heads) and
the output projection row-wise; in the MLP, up column-wise and down row-wise.

Sequence parallelism (``sequence_parallel=True``, GPT only) also splits the
parts that column/row pairs leave whole: LayerNorms and the residual stream are
sharded along the sequence. The all-reduce becomes a reduce-scatter (into
sequence shards) plus an all-gather before the next attention or MLP: the same
bytes, but activations outside the pairs take 1/tp of the memory.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models import MLP, TinyGPT


def mlp_plan(model: MLP) -> dict:
    """Pair the layers: even layers column-wise, the next one row-wise; an odd last layer stays whole."""
    names = list(model.layers)
    plan = {}
    for first, second in zip(names[0::2], names[1::2]):
        plan[f"layers.{first}"] = ColwiseParallel()
        plan[f"layers.{second}"] = RowwiseParallel()
    return plan


def gpt_plan(model: TinyGPT, sequence_parallel: bool) -> dict:
    plan = {}
    for name in model.blocks:
        block = f"blocks.{name}"
        plan.update(
            {
                f"{block}.attn.q": ColwiseParallel(),
                f"{block}.attn.k": ColwiseParallel(),
                f"{block}.attn.v": ColwiseParallel(),
                f"{block}.attn.out": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
                f"{block}.mlp.up": ColwiseParallel(),
                f"{block}.mlp.down": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
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
        if model.embed is not None:
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        if model.norm is not None:
            plan["norm"] = SequenceParallel()
            # The head stays whole on every rank; it gets the whole sequence as a plain tensor.
            plan["head"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    if isinstance(model, TinyGPT):
        plan = gpt_plan(model, sequence_parallel)
    elif isinstance(model, MLP):
        plan = mlp_plan(model)
    else:
        raise TypeError(f"no tensor-parallel plan for {type(model).__name__}")
    return parallelize_module(model, tp_mesh, plan)
