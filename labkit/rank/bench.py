"""Rank side of the collective benchmark: time one collective over message sizes, and a memory copy.

Importable without torch (the notebook pickles these functions by reference);
torch is imported when they run on a rank. On GPUs the messages live on the
rank's device and the clock is read after ``torch.cuda.synchronize``, since a
collective returns before the GPU has run it.
"""

from __future__ import annotations

import statistics
import time


def _rank_device():
    from labkit.wire.current import this_rank

    return this_rank().device


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(operation: str, sizes, iterations: int, warmup: int) -> list[float]:
    """Rank side: seconds per operation for each size (this rank's view), on the rank's device."""
    import torch
    import torch.distributed as dist

    device = _rank_device()
    world = dist.get_world_size()
    results = []
    for size in sizes:
        count = max(world, size // 4) // world * world  # float32 elements, divisible by the world
        whole = torch.ones(count, device=device)
        part = torch.ones(count // world, device=device)
        run = {
            "all_reduce": lambda: dist.all_reduce(whole),
            "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
            "broadcast": lambda: dist.broadcast(whole, src=0),
        }[operation]
        for _ in range(warmup):
            run()
        _synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iterations):
            run()
        _synchronize(device)
        results.append((time.perf_counter() - began) / iterations)
    return results


def free_memory() -> tuple[str, int]:
    """(where this rank's messages live, bytes free there): a GPU of a host, or a host's memory, which the
    ranks on that host share."""
    import socket

    import psutil

    device = _rank_device()
    if device.type == "cuda":
        import torch

        return f"{device}@{socket.gethostname()}", int(torch.cuda.mem_get_info(device)[0])
    return socket.gethostname(), int(psutil.virtual_memory().available)


def memcpy_bandwidth(size: int = 64 * 2**20, repeats: int = 10) -> float:
    """Bytes per second of a large tensor copy on the rank's device (read and write of ``size`` bytes)."""
    import torch

    device = _rank_device()
    source, target = torch.ones(size // 4, device=device), torch.empty(size // 4, device=device)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        began = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        times.append(time.perf_counter() - began)
    return size / statistics.median(times)
