"""Bytes per rank: parameters, gradients and optimizer state, counted on what the rank holds.

A sharded parameter (a DTensor from FSDP or TP) counts only its local shard;
a parameter shared by two modules counts once. Activations are not counted:
the budget is about what data parallelism copies to every rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _unique(parameters):
    seen = set()
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield parameter


def memory_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra_state=()) -> dict[str, int]:
    """``extra_state``: objects a strategy keeps beside the optimizer (DiLoCo's global copy and
    outer momentum); what each one's ``nbytes()`` says is counted as optimizer state."""
    parameters = list(_unique(module.parameters()))
    state = sum(extra.nbytes() for extra in extra_state if hasattr(extra, "nbytes"))
    if optimizer is not None:
        for values in optimizer.state.values():
            state += sum(local_bytes(value) for value in values.values() if isinstance(value, torch.Tensor))
    return {
        "params": sum(local_bytes(p) for p in parameters),
        "grads": sum(local_bytes(p.grad) for p in parameters),
        "optimizer": state,
    }


def estimated_bytes(param_bytes: int, optimizer_states: int) -> dict[str, int]:
    """Before training: gradients are as large as parameters; each optimizer state too."""
    return {"params": param_bytes, "grads": param_bytes, "optimizer": optimizer_states * param_bytes}
