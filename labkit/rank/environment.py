"""What a rank looks like to a program written for torchrun: its environment, backend and random state.

torchrun starts each process with variables that programs read (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and with its own random
state. Ranks forked from the lab's process host would all inherit the host's
state: the same ``torch.initial_seed()`` everywhere, so unseeded dropout or
sampling would silently be identical on every rank. So each rank draws fresh
seeds from the operating system when it starts (and a replaced rank when it
is replaced), and ``seed`` sets them reproducibly on request.

Runs in the engines; pure apart from setting ``os.environ`` and the generators.
"""

from __future__ import annotations

import os
import random

import torch


def torchrun_environment(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int | None = None,
                         local_world_size: int | None = None, host_index: int = 0, host_count: int = 1) -> dict[str, str]:
    """The variables torchrun sets for one process; by default every rank on one machine."""
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(host_index),  # torchrun's "group" is a machine (a node)
        "GROUP_WORLD_SIZE": str(host_count),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": "labkit",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def seed_all(value: int) -> None:
    """Seed torch (every device), Python's ``random`` and numpy's global generator with ``value``."""
    torch.manual_seed(value)
    random.seed(value)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(value % 2**32)


def seed_independently() -> int:
    """Seed everything from the operating system's entropy, as a fresh process would be; return the seed."""
    value = int.from_bytes(os.urandom(8), "little") % 2**63
    seed_all(value)
    return value


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for the lab's backend.

    nccl carries only CUDA tensors, but the lab's own traffic (agreeing to stop,
    averaging the loss for a progress line, the verdict of a verification) is
    small CPU tensors: gloo carries those beside nccl, in the same group.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def device_name(device: torch.device) -> str:
    """'NVIDIA H200' for a GPU; 'cpu' otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
