"""Data parallelism: every rank holds the whole model, gradients are averaged.

Two forms, the simple one first:

- ``GradientAllReduce`` is data parallelism written out: after backward, each
  gradient is all-reduced over the dp group and divided by its size. labkit uses
  it where torch's DDP cannot go: under tensor parallelism (DDP's reducer does
  not hold DTensor parameters) and under pipeline parallelism (a schedule runs
  several forwards before their backwards, which DDP's reducer rejects).
- ``apply_ddp`` wraps the model in ``DistributedDataParallel``, which buckets
  gradients (``bucket_cap_mb``) and overlaps their all-reduce with the rest of
  the backward pass; ``no_sync`` skips it for gradient-accumulation micro-steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh, bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    """Wrap ``model`` for data parallelism over the mesh's dp axis."""
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        raise ValueError("DistributedDataParallel cannot hold tensor-parallel (DTensor) parameters; use GradientAllReduce")
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb)


def accumulation_context(model: nn.Module, last_micro_step: bool):
    """DDP's ``no_sync`` on every micro-step but the last; a no-op for other models."""
    if isinstance(model, DistributedDataParallel) and not last_micro_step:
        return model.no_sync()
    return contextlib.nullcontext()


class GradientAllReduce:
    """Average gradients over the dp group by hand, one flat buffer per dtype."""

    def __init__(self, modules, dp_mesh) -> None:
        self.parameters = [p for module in modules for p in module.parameters() if p.requires_grad]
        self.group = dp_mesh.get_group()
        self.size = dp_mesh.size()

    def __call__(self) -> None:
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
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def apply(composition, dp_mesh, config) -> None:
    """Catalog entry point. Next to TP or PP, gradients are averaged by hand after backward
    (torch's DDP holds neither DTensor parameters nor a schedule's several forwards)."""
    if composition.estimate_only:
        return  # a whole copy per rank: nothing to shard
    if composition.uses("tp") or composition.uses("pp"):
        composition.grad_syncs.append(GradientAllReduce([composition.model], dp_mesh))
    else:
        composition.model = apply_ddp(composition.model, dp_mesh, config.bucket_cap_mb)
