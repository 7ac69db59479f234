"""Tensor parallelism with DTensor's ``parallelize_module``: one layer split over ranks.

The classic pairing (Megatron): a column-wise linear layer splits its output
features, so each rank computes its slice of the activations with no
communication; the following row-wise layer splits its input features, so each
rank computes a partial sum, and one all-reduce makes the output whole.

Which layers pair up is the model's to say: every zoo model has a
``tp_plan(sequence_parallel)`` method (``labkit/zoo/mlp.py``,
``labkit/zoo/gpt.py``) that maps its submodule names to DTensor styles, and
``apply_tp`` hands that plan to ``parallelize_module``. In the GPT block, q/k/v
are column-wise (each rank owns some attention heads) and the output
projection row-wise; in the MLP, even layers column-wise and the next row-wise.

Sequence parallelism (``sequence_parallel=True``, GPT only) also splits the
parts that column/row pairs leave whole: LayerNorms and the residual stream are
sharded along the sequence. The all-reduce becomes a reduce-scatter (into
sequence shards) plus an all-gather before the next attention or MLP: the same
bytes, but activations outside the pairs take 1/tp of the memory.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` by the plan the model gives for itself (``model.tp_plan``)."""
    tp_plan = getattr(model, "tp_plan", None)
    if tp_plan is None:
        raise TypeError(
            f"no tensor-parallel plan for {type(model).__name__}: give it a tp_plan(sequence_parallel) method "
            "that maps its submodule names to DTensor parallel styles"
        )
    return parallelize_module(model, tp_mesh, tp_plan(sequence_parallel))


def apply(composition, tp_mesh, config) -> None:
    """Catalog entry point: shard the model's layers over the tp axis by its own plan."""
    apply_tp(composition.model, tp_mesh, config.sequence_parallel)
