"""Which GPUs a process may use and which one a rank takes: the rules both sides apply.

The notebook reads them to place ranks (``cluster.placement``) without importing
torch; a rank and a torchrun-started script read them to pick their device.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from typing import Mapping


def visible_gpus(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """GPU ids this process may use, honouring CUDA_VISIBLE_DEVICES, without importing torch."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(part.strip() for part in listed.split(",") if part.strip() and part.strip() != "-1")
    count = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    if count == 0 and shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
            count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    return tuple(str(index) for index in range(count))


def gpu_index(local_rank: int, gpus_shown: int | None) -> int:
    """The CUDA device index a nccl rank (or a torchrun-started process) uses: the rule in one place.

    The LOCAL_RANK-th of the GPUs its process sees, as torchrun places ranks; but a process shown
    exactly one GPU (as some schedulers show each process its own) has only cuda:0.
    ``gpus_shown``: how many CUDA_VISIBLE_DEVICES lists, None where it is unset (then the process sees
    all its host's GPUs, and ``check_host_places`` has kept ``local_rank`` below their count).
    """
    return 0 if gpus_shown == 1 else local_rank


def gpus_shown(environ: Mapping[str, str] = os.environ) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES shows this process; None where it is unset (all of them)."""
    return None if environ.get("CUDA_VISIBLE_DEVICES") is None else len(visible_gpus(environ))
