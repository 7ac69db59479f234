"""Pinned host buffers for copies between the CPU and a GPU, kept and reused from step to step.

Why pinned: a copy from pageable memory goes through the driver's own pinned
bounce buffer, and ``non_blocking=True`` does not help, since the CPU must wait
while the driver copies. From page-locked memory the GPU's copy engine reads the
bytes itself, and the CPU goes on at once. ``tensor.pin_memory()`` would pin a
new tensor every step, and keeps a view's strides, so a view (a GPT batch is
``tokens[:, :-1]``) would still be copied through a pageable temporary.

Why a fence: a copy from a pinned buffer with ``non_blocking=True`` has only
been enqueued when the call returns; the GPU reads the buffer later, in stream
order. Writing the buffer again before that read has happened would send the
GPU the next step's bytes. So whoever enqueues reads of a buffer ``release``s it
(a CUDA event recorded after them), and whoever writes it first ``acquire``s it
(the CPU waits on that event, a no-op once the GPU has passed it).

- ``HostBuffer``: one persistent host tensor and the fence that guards it;
- ``PinnedStaging``: a rank's batches copied to its GPU through ``slots``
  sets of such buffers (one per dtype in each), used in turn.

Both take the allocator and the fence as arguments, so their logic runs in the
CPU tests with stand-ins (a CPU build of torch cannot pin memory).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class Fence(Protocol):
    def record(self) -> None: ...  # after the GPU work that reads the buffer has been enqueued

    def wait(self) -> None: ...  # blocks the CPU until that work is done


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class CudaFence:
    """A CUDA event in the device's current stream (the stream a ``non_blocking`` copy goes on)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event()  # waiting on one never recorded returns at once

    def record(self) -> None:
        # The device's stream, named: the process's current device need not be the rank's.
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        self.event.synchronize()


class NoFence:
    """For a buffer no GPU reads asynchronously (a link's buffers where no GPU's tensors cross it)."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class HostBuffer:
    """A flat tensor kept for reuse (in host memory, where it matters), with the fence that says when
    the GPU is done reading it."""

    def __init__(self, numel: int, dtype: torch.dtype, allocate: Callable[[int, torch.dtype], torch.Tensor],
                 fence: Callable[[], Fence]) -> None:
        self.tensor = allocate(numel, dtype)
        self._fence = fence()

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def acquire(self) -> torch.Tensor:
        """The tensor, once no copy enqueued from it is still to run: safe to overwrite."""
        self._fence.wait()
        return self.tensor

    def release(self) -> None:
        """Call after enqueuing the GPU's reads of the tensor; the next ``acquire`` waits for them."""
        self._fence.record()


class PinnedStaging:
    """A rank's batches on its GPU, copied from pinned buffers that live as long as the staging.

    Each call packs the tensors it is given into one buffer per dtype (a plain
    CPU copy, which also makes a strided view contiguous), then enqueues one
    ``non_blocking`` copy per tensor from a view of that buffer. A buffer grows
    when a batch is larger than it, and is otherwise the same memory every step.

    Two slots by default (double buffering), used in turn, each with its own
    fence. With one, step n+1 could not write its batch before the GPU had
    copied step n's, and that copy waits in the stream behind step n-1's
    kernels: the CPU could never get more than one step ahead, so the GPU
    would have at most one step queued, and a CPU pause longer than one GPU
    step (a progress line, a checkpoint) would leave it idle. With two, the
    wait is for the copy of two steps ago, which a GPU keeping up has long
    finished, and the GPU may have two steps queued; the price is a second
    batch of pinned memory, kilobytes for the zoo's batches.

    Meant for a device that is not the host: on the host the caller skips it
    (there is nothing to copy), as the training loop does.
    """

    def __init__(self, device: torch.device, slots: int = 2,
                 allocate: Callable[[int, torch.dtype], torch.Tensor] = pinned_empty,
                 fence: Callable[[], Fence] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self.device = device
        self._allocate = allocate
        self._fence = fence or (lambda: CudaFence(device))
        self._slots: list[dict[torch.dtype, HostBuffer]] = [{} for _ in range(slots)]
        self._turn = 0

    def buffers(self, slot: int) -> dict[torch.dtype, HostBuffer]:
        """The buffers of one slot, by dtype (what the tests look at)."""
        return self._slots[slot]

    def to_device(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``tensors`` on the device, each a contiguous tensor of its own; the call does not wait
        for the GPU unless this slot's copies of ``slots`` calls ago are still to run."""
        slot = self._slots[self._turn]
        self._turn = (self._turn + 1) % len(self._slots)
        needed: dict[torch.dtype, int] = {}
        for tensor in tensors:
            needed[tensor.dtype] = needed.get(tensor.dtype, 0) + tensor.numel()
        flat: dict[torch.dtype, torch.Tensor] = {}
        for dtype, numel in needed.items():
            buffer = slot.get(dtype)
            if buffer is not None and buffer.numel < numel:
                buffer.acquire()  # its copies must be done before its memory goes back to the allocator
                buffer = None
            if buffer is None:
                buffer = slot[dtype] = HostBuffer(numel, dtype, self._allocate, self._fence)
            flat[dtype] = buffer.acquire()
        offsets = dict.fromkeys(needed, 0)
        copied = []
        for tensor in tensors:
            start = offsets[tensor.dtype]
            offsets[tensor.dtype] = start + tensor.numel()
            view = flat[tensor.dtype][start : start + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)  # host to host: any strides in, contiguous out
            copied.append(view.to(self.device, non_blocking=True))
        for dtype in needed:
            slot[dtype].release()
        return tuple(copied)
