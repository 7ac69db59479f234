"""Which of a rank's variables hold distributed objects: what stops working when the ranks form a new world.

Runs in the engines. When a rank is replaced (or the world resized), every process group
of before is retired, and so is everything built on one: a DDP module, an FSDP2 or
tensor-parallel model (its DTensor parameters), a DTensor, a DeviceMesh, a group. The
other ranks keep their variables, so the lab names the ones that can no longer be used,
rank by rank, instead of leaving the user to find out from the first error.
"""

from __future__ import annotations

import sys

import torch

# Names the lab itself puts in a rank's namespace (the lab rebuilds its own mesh).
LAB_NAMES = frozenset({"rank", "world_size", "device", "mesh", "torch", "dist", "exit", "quit"})


def _kind(value) -> str | None:
    """What distributed object ``value`` is, in words; None when it is none."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(value, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(value, dist.ProcessGroup):
        return "process group"
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is not None and isinstance(value, mesh_module.DeviceMesh):
        return "DeviceMesh"
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:
        return None
    if isinstance(value, tensor_module.DTensor):
        return "DTensor"
    if isinstance(value, torch.nn.Module) and any(isinstance(p, tensor_module.DTensor) for p in value.parameters()):
        return f"{type(value).__name__} with DTensor parameters (FSDP or tensor parallel)"
    if isinstance(value, torch.optim.Optimizer) and any(
            isinstance(p, tensor_module.DTensor) for group in value.param_groups for p in group["params"]):
        return f"{type(value).__name__} of DTensor parameters"
    return None


def distributed_variables(namespace: dict) -> list[str]:
    """``name (what it is)`` for each variable of ``namespace`` that holds a distributed object, directly
    or in a list, tuple or dict one level down."""
    found = []
    for name, value in list(namespace.items()):
        if name.startswith("_") or name in LAB_NAMES:
            continue
        kind = _kind(value)
        if kind is None and isinstance(value, (list, tuple, dict)):
            items = value.values() if isinstance(value, dict) else value
            kinds = sorted({k for item in list(items)[:1000] if (k := _kind(item)) is not None})
            if kinds:
                kind = f"{type(value).__name__} holding {', '.join(kinds)}"
        if kind is not None:
            found.append(f"{name} ({kind})")
    return sorted(found)
