"""How long each training step took, on the clock that sees the work.

On CPU that is the wall clock around the step. On a GPU the CPU only enqueues
the step's kernels, so the time between the CPU's calls says nothing about
the GPU's work: ``StepTimer`` records a CUDA event where each step begins on
the compute stream and reads it only once the device has passed it, so
measuring never makes the loop wait. A GPU step's time runs from its begin
event to the next step's: when the CPU cannot keep the GPU fed (preparing the
next batch, say), the idle GPU time between steps is part of the step, as it
is part of the run. Events are read and let go as the run goes, so a long run
does not hold one per step.
"""

from __future__ import annotations

import time
from collections import deque

import torch


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: list[float] = []  # steps whose time is known
        self._began: float | None = None  # CPU: when the current step began
        self._begins: deque = deque()  # GPU: begin events not read yet (the last one is the current step's)
        self._last_end: torch.cuda.Event | None = None  # GPU: the end event of the latest step

    def begin(self) -> None:
        if not self.cuda:
            self._began = time.perf_counter()
            return
        self._begins.append(_cuda_event())
        self._read(wait=False)

    def end(self) -> None:
        if not self.cuda:
            assert self._began is not None  # begin came first
            self._seconds.append(time.perf_counter() - self._began)
            return
        self._last_end = _cuda_event()

    def abandon(self) -> None:
        """The step begun last ends without being counted (a run stopped before its update)."""
        if not self.cuda:
            self._began = None
        elif self._begins:
            self._begins.pop()  # the current step's begin event: unread, so the last one in the queue

    def _read(self, wait: bool) -> None:
        """Turn every period whose closing begin event the device has passed into seconds."""
        while len(self._begins) >= 2 and (wait or self._begins[1].query()):
            if wait:
                self._begins[1].synchronize()
            self._seconds.append(self._begins[0].elapsed_time(self._begins[1]) / 1000.0)
            self._begins.popleft()

    def seconds_of(self, step: int) -> float | None:
        """Step ``step``'s time if it is known now without waiting for the device."""
        return self._seconds[step] if 0 <= step < len(self._seconds) else None

    def seconds(self) -> list[float]:
        """Every step's time (on a GPU, waits for the last step to finish)."""
        if self.cuda and self._begins:
            self._read(wait=True)
            assert self._last_end is not None  # every step begun has ended
            self._last_end.synchronize()
            self._seconds.append(self._begins.popleft().elapsed_time(self._last_end) / 1000.0)
        return self._seconds
