"""Fully sharded data parallelism with FSDP2 (``fully_shard``).

Every rank keeps 1/dp of each parameter, its gradient and its optimizer state.
Before a block runs, its parameters are all-gathered; after backward, gradients
are reduce-scattered so each rank keeps only its shard of the average.
``reshard_after_forward=True`` frees each unit's gathered parameters after forward
(and gathers them again for backward): less memory, more communication. The root
keeps its own gathered (torch's default), since backward needs them first.

Each of the units the model offers (``fsdp_units``: a transformer's blocks, an
MLP's layers) is its own FSDP unit, so only one unit's full parameters exist at
a time; the root module holds what is left. A model that offers none is one
unit.

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

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager

from labkit.strategies.catalog import Setting, Strategy
from labkit.zoo.model_protocol import HasFsdpUnits

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

RESHARD_AFTER_FORWARD = Setting("reshard_after_forward", True, "FSDP: free gathered parameters after forward",
                                flag="--no-reshard")

STRATEGY = Strategy(
    "fsdp", axis="dp", order=2, shards_memory=True, list_position=20,
    summary="fully sharded data parallel: parameters, gradients and optimizer state sharded (FSDP2)",
    settings=(RESHARD_AFTER_FORWARD,),
    model_options=("fsdp_units",),
)


def units_of(model: nn.Module, plan: object | None = None) -> list[nn.Module]:
    """The modules sharded as units of their own: what the model (or ``plan``, speaking for it) offers."""
    offered = model if plan is None else plan
    return offered.fsdp_units() if isinstance(offered, HasFsdpUnits) else []


def mixed_precision(precision: str, root: bool) -> MixedPrecisionPolicy:
    """bf16 compute with float32 gradient reduction; only the whole model's output goes back to float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32 if root else None)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True, backend: str = "gloo",
               precision: str = "fp32", plan: object | None = None) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for unit in units_of(model, plan):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision(precision, root=False))
    # The root's parameters are the first that backward needs: resharding them after forward would only
    # gather them again at once (one more all-gather per step; 10% of a small CNN's step on 4 CPU ranks).
    # torch's own default keeps them, as here.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mixed_precision(precision, root=True))
    if backend == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def gradient_sync_on_last(model: nn.Module, last: bool) -> ContextManager[Any]:
    """Reduce-scatter gradients only on a step's last accumulation micro-step."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def apply(composition: Composition, dp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Shard over the dp axis, unit by unit; FSDP's own policy handles bf16."""
    model = apply_fsdp(composition.model, dp_mesh, config.setting(RESHARD_AFTER_FORWARD), composition.backend,
                       config.precision, plan=composition.plan)
    composition.micro_step = lambda last: gradient_sync_on_last(model, last)
    composition.own_precision = True
