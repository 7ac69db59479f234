"""Holding a GPU stream back for a given time: a slow device, or a slow link, as a GPU sees it.

A GPU rank's CPU only enqueues kernels and runs ahead of its GPU, so a delay spent
on the CPU (a busy-wait, a sleep) is absorbed: the GPU still has queued work and
the step takes as long as before. A delay must sit in the stream itself.
``torch_internals.spin_gpu`` (torch's private ``cuda._sleep``) enqueues a kernel
that spins for a number of GPU clock cycles; ``StreamDelay`` learns once how many cycles make a second on its
device (timed with CUDA events) and then enqueues as many as a delay needs on the
current stream, without making the CPU wait.
"""

from __future__ import annotations

import statistics

import torch

from labkit.torch_support.torch_internals import spin_gpu

_CALIBRATION_CYCLES = 2_000_000  # ~1 ms on current GPUs: long enough to time, short enough to be free
_CALIBRATION_RUNS = 5


class StreamDelay:
    """Enqueue spinning kernels worth ``seconds`` on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cycles_per_second: float | None = None

    def calibrate(self) -> float:
        """GPU clock cycles per second of ``spin_gpu``, measured once (a median of a few runs)."""
        if self.cycles_per_second is None:
            with torch.cuda.device(self.device):
                spin_gpu(_CALIBRATION_CYCLES)  # the first launch loads the kernel: not timed
                rates = []
                for _ in range(_CALIBRATION_RUNS):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    spin_gpu(_CALIBRATION_CYCLES)
                    end.record()
                    end.synchronize()
                    rates.append(_CALIBRATION_CYCLES / max(start.elapsed_time(end) / 1000.0, 1e-9))
            self.cycles_per_second = statistics.median(rates)
        return self.cycles_per_second

    def delay(self, seconds: float) -> float:
        """Hold the current stream back by ``seconds`` (the CPU goes on at once); the delay asked."""
        if seconds <= 0:
            return 0.0
        cycles = int(seconds * self.calibrate())
        with torch.cuda.device(self.device):
            spin_gpu(max(cycles, 1))
        return seconds
