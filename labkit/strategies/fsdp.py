"""Fully sharded data parallelism with FSDP2 (``fully_shard``).

Every rank keeps 1/dp of each parameter, its gradient and its optimizer state.
Before a block runs, its parameters are all-gathered; after backward, gradients
are reduce-scattered so each rank keeps only its shard of the average.
``reshard_after_forward=True`` frees the gathered parameters after forward (and
gathers them again for backward): less memory, more communication.

Each transformer block (or MLP layer) is its own FSDP unit, so only one block's
full parameters exist at a time; the root module holds what is left.

gloo pitfall (pytorch#162338): FSDP2 once relied on gloo's AVG reduce-scatter,
which divided by the wrong count, so gradients came out summed instead of
averaged. labkit asks FSDP for SUM reductions with its own division on gloo, so
the result never depends on gloo's AVG; a test compares the gradients with
single-process training.

Mixed precision (``precision="bf16"``): FSDP's ``MixedPrecisionPolicy`` gathers
parameters in bfloat16 for compute and reduces gradients in float32, while the
shards, and the optimizer, keep float32; the model's output is cast back to
float32 so the loss is computed in full precision.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def repeated_layers(model: nn.Module):
    """The model's repeated units: GPT blocks or MLP layers (whichever this stage kept)."""
    container = getattr(model, "blocks", None) or getattr(model, "layers", None)
    return list(container.values()) if container is not None else []


def mixed_precision(precision: str, root: bool) -> MixedPrecisionPolicy:
    """bf16 compute with float32 gradient reduction; only the whole model's output goes back to float32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32 if root else None)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh, reshard_after_forward: bool = True, backend: str = "gloo",
               precision: str = "fp32") -> nn.Module:
    for layer in repeated_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision(precision, root=False))
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=mixed_precision(precision, root=True))
    if backend == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def apply(composition, dp_mesh, config) -> None:
    """Catalog entry point: shard over the dp axis; FSDP's own policy handles bf16."""
    apply_fsdp(composition.model, dp_mesh, config.reshard_after_forward, composition.backend, config.precision)
    composition.own_precision = True
