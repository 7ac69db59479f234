"""Data parallelism: every rank holds the whole model, gradients are averaged.

Two forms, the simple one first:

- ``GradientAllReduce`` is data parallelism written out: after backward, each
  gradient is all-reduced over the dp group and divided by its size. labkit uses
  it where torch's DDP cannot go, which the other parts of a composition say
  (``Composition.reducer_unfit``): tensor parallelism (DDP's reducer does not
  hold DTensor parameters) and pipeline parallelism (a schedule runs several
  forwards before their backwards, which DDP's reducer rejects).
- ``apply_ddp`` wraps the model in ``DistributedDataParallel``, which buckets
  gradients (``bucket_cap_mb``) and overlaps their all-reduce with the rest of
  the backward pass; ``no_sync`` skips it for gradient-accumulation micro-steps.

The declaration loads without torch; ``apply`` and the helpers import it on the ranks.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager

from labkit.strategies.catalog import Setting, Strategy

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

# Below a million MB (a terabyte): a bucket larger than all of a model's gradients is simply one bucket.
BUCKET_CAP_MB = Setting("bucket_cap_mb", 25.0, "DDP gradient bucket size, MB", below=1e6)

STRATEGY = Strategy(
    "ddp", axis="dp", order=2, list_position=10,
    summary="data parallel: a whole model per rank, gradients averaged (torch DDP)",
    settings=(BUCKET_CAP_MB,),
    over_budget="Data parallelism keeps a whole copy of the model, its gradients and optimizer state on "
                "every rank: adding ranks never makes it fit.",
)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    """Wrap ``model`` for data parallelism over the mesh's dp axis."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        raise ValueError("DistributedDataParallel cannot hold tensor-parallel (DTensor) parameters; "
                         "use GradientAllReduce")
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb)


def accumulation_context(model: nn.Module, last_micro_step: bool) -> ContextManager[Any]:
    """DDP's ``no_sync`` on every micro-step but the last; a no-op for other models."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not last_micro_step:
        return model.no_sync()
    return contextlib.nullcontext()


class GradientAllReduce:
    """Average gradients over the dp group by hand, one flat buffer per dtype."""

    def __init__(self, modules: list[nn.Module], dp_mesh: DeviceMesh) -> None:
        self.parameters = [p for module in modules for p in module.parameters() if p.requires_grad]
        self.group = dp_mesh.get_group()
        self.size = dp_mesh.size()

    def __call__(self) -> None:
        import torch
        import torch.distributed as dist

        if self.size == 1:
            return
        grads = [_local(p.grad) for p in self.parameters if p.grad is not None]
        # One all-reduce of a flat buffer instead of one per tensor: the same bytes,
        # far fewer messages (this is what DDP's buckets do, in one bucket).
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def apply(composition: Composition, dp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Wrap the model in DDP; where the other parts leave a model DDP cannot hold, average by hand after
    backward instead."""
    if composition.estimate_only:
        return  # a whole copy per rank: nothing to shard
    if composition.reducer_unfit:
        composition.grad_syncs.append(GradientAllReduce([composition.model], dp_mesh))
    else:
        model = composition.model = apply_ddp(composition.model, dp_mesh, config.setting(BUCKET_CAP_MB))
        composition.micro_step = lambda last: accumulation_context(model, last)
