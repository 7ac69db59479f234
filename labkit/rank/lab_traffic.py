"""Tensors for the lab's own small messages between ranks (agreeing to stop, a loss for a progress line,
a verification's verdict), on whichever device the group carries."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.torch_support.torch_internals import device_types


def control_tensor(values, dtype=torch.float32, group=None) -> torch.Tensor:
    """A small tensor for the lab's own traffic: on CPU when the group carries CPU tensors
    (gloo, or gloo beside nccl), else on this process's GPU (a group of nccl alone)."""
    group = group or dist.group.WORLD
    if any(device.type == "cpu" for device in device_types(group)):
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
