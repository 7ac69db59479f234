"""Which step recorder a rank uses: CPU clocks (``recorder.StepRecorder``) or CUDA events (``gpu_recorder``)."""

from __future__ import annotations

from labkit.rank.instruments.gpu_recorder import CudaStepRecorder
from labkit.rank.instruments.recorder import StepRecorder


def recorder_for(rank: int, device):
    """The step recorder that can see this rank's work: CPU clocks, or CUDA events on a GPU."""
    if getattr(device, "type", "cpu") == "cuda":
        return CudaStepRecorder(rank, device)
    return StepRecorder(rank)
