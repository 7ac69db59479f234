"""How long each training step took, on the clock that sees the work.

On CPU that is the wall clock around the step. On a GPU the CPU only enqueues
the step's kernels, so the time between the CPU's calls says nothing about
the GPU's work: ``StepTimer`` records a CUDA event where each step begins and
ends on the compute stream and reads them only when asked, after the device
has passed them, so measuring never makes the loop wait. A GPU step's time runs
from its begin event to the next step's: when the CPU cannot keep the GPU fed
(preparing the next batch, say), the idle GPU time between steps is part of the
step, as it is part of the run.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple] = []
        self._began = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._began = self._now()

    def end(self) -> None:
        self._marks.append((self._began, self._now()))

    def seconds_of(self, step: int) -> float | None:
        """Step ``step``'s time if it is known now without waiting for the device."""
        if not 0 <= step < len(self._marks):
            return None
        began, ended = self._marks[step]
        if not self.cuda:
            return ended - began
        return began.elapsed_time(ended) / 1000.0 if ended.query() else None

    def seconds(self) -> list[float]:
        """Every step's time (on a GPU, waits for the last step to finish)."""
        if not self.cuda:
            return [ended - began for began, ended in self._marks]
        if not self._marks:
            return []
        self._marks[-1][1].synchronize()
        periods = [began.elapsed_time(following) / 1000.0
                   for (began, _), (following, _) in zip(self._marks, self._marks[1:])]
        began, ended = self._marks[-1]
        return periods + [began.elapsed_time(ended) / 1000.0]
