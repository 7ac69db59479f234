"""Which backend and which device each rank gets, decided before anything starts.

Pure logic plus two cheap probes (``visible_gpus``, ``loopback_interface``); it
never imports torch, so the notebook can refuse a bad request in milliseconds.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from labkit.spec.errors import LabConfigError

BACKENDS = ("gloo", "nccl")
# What one rank needs of the machine. Measured on the 2-core development machine (gloo, torch
# 2.13): a rank forked from the process host holds about 90 MB of its own at start (its
# unique set, USS) and about 150 MB after a small training run, besides pages it shares with
# the host; 200 MB leaves room for the user's own tensors in a workshop.
RANK_MEMORY_BYTES = 200 * 10**6
MEMORY_SHARE = 0.8  # of what is free: the notebook and everything else need the rest
RANKS_PER_CORE = 16  # past this, ranks queue for the cores long enough to time out collectives


class DeviceError(LabConfigError):
    """The requested backend or rank count does not fit the devices this machine has."""


@dataclass(frozen=True)
class RankPlan:
    """How every rank of a lab is placed: backend, threads, per-rank environment."""

    backend: str
    ranks: int
    threads_per_rank: int
    check_collectives: bool = False
    gpus: tuple[str, ...] = ()
    env_per_rank: tuple[dict, ...] = field(default_factory=tuple)

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def describe(self) -> str:
        if self.backend == "nccl":
            return f"{self.ranks} ranks, nccl, one GPU each ({', '.join(self.gpus)})"
        checked = ", collectives checked" if self.check_collectives else ""
        return f"{self.ranks} ranks, gloo on CPU, {self.threads_per_rank} thread(s) each{checked}"


def visible_gpus(environ=os.environ) -> tuple[str, ...]:
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


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = {name for _, name in socket.if_nameindex()}
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return "lo"


def _count(number: int, noun: str) -> str:
    """'1 rank', '2 ranks': the refusal is read by people, so it should read right."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def largest_lab(cpu_count: int, available_bytes: int) -> tuple[int, str]:
    """The most ranks this machine holds, and what limits it, in words."""
    by_memory = int(available_bytes * MEMORY_SHARE // RANK_MEMORY_BYTES)
    by_cores = cpu_count * RANKS_PER_CORE
    if by_memory <= by_cores:
        return max(1, by_memory), (f"{available_bytes / 1e9:.1f} GB of memory free, about "
                                   f"{RANK_MEMORY_BYTES / 1e6:.0f} MB per rank")
    return by_cores, f"{_count(cpu_count, 'core')}, at most {RANKS_PER_CORE} ranks each"


def check_capacity(ranks: int, cpu_count: int, available_bytes: int) -> None:
    """Refuse, before anything starts, more ranks than the machine can hold."""
    most, reason = largest_lab(cpu_count, available_bytes)
    if ranks > most:
        raise DeviceError(
            f"{ranks} ranks will not fit this machine: it holds at most {_count(most, 'rank')} ({reason}). "
            f"Ask for at most {most}, or pass oversubscribe=True (%lab start --oversubscribe) to start them anyway"
        )


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def plan_ranks(
    ranks: int,
    backend: str | None = None,
    gpus: tuple[str, ...] | None = None,
    threads_per_rank: int | None = None,
    cpu_count: int | None = None,
    store_host: str = "127.0.0.1",
    interface: str | None = None,
    oversubscribe: bool = False,
    available_memory: int | None = None,
    check_collectives: bool = False,
) -> RankPlan:
    """Check a request against the machine and decide each rank's environment.

    With GPUs visible the default is nccl, one rank per GPU; without them gloo on
    CPU. Asking for nccl without GPUs, for more nccl ranks than GPUs, or for more
    ranks than the machine's memory and cores hold (unless ``oversubscribe``)
    raises ``DeviceError`` with what to do instead.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise DeviceError(f"ranks must be a positive integer, got {ranks!r}")
    for name, flag in (("oversubscribe", oversubscribe), ("check_collectives", check_collectives)):
        if not isinstance(flag, bool):
            raise DeviceError(f"{name} is True or False, got {flag!r}")
    gpus = visible_gpus() if gpus is None else tuple(gpus)
    if backend is None:
        backend = "nccl" if gpus else "gloo"
    if not isinstance(backend, str):
        raise DeviceError(f"backend is a name, one of {', '.join(BACKENDS)} (or None to choose), got {backend!r}")
    backend = backend.lower()
    if backend not in BACKENDS:
        raise DeviceError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        if not gpus:
            raise DeviceError(
                "nccl needs GPUs and none are visible to this process "
                "(check CUDA_VISIBLE_DEVICES); use backend='gloo' to run ranks on CPU"
            )
        if ranks > len(gpus):
            raise DeviceError(
                f"nccl runs one rank per GPU: {ranks} ranks asked, {_count(len(gpus), 'GPU')} visible "
                f"({', '.join(gpus)}); ask for at most {_count(len(gpus), 'rank')}, or use backend='gloo'"
            )
    cpu_count = cpu_count or os.cpu_count() or 1
    if not oversubscribe:
        check_capacity(ranks, cpu_count, _available_memory() if available_memory is None else available_memory)
    if threads_per_rank is None:
        threads_per_rank = max(1, cpu_count // ranks)
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise DeviceError(f"threads_per_rank must be a positive integer, got {threads_per_rank!r}")
    interface = interface or loopback_interface()
    env_per_rank = []
    for rank in range(ranks):
        env = {
            "LABKIT_RANK": str(rank),
            "LABKIT_WORLD_SIZE": str(ranks),
            "LABKIT_BACKEND": backend,
            "LABKIT_THREADS": str(threads_per_rank),
            "LABKIT_STORE_HOST": store_host,
            "OMP_NUM_THREADS": str(threads_per_rank),
            # gloo and nccl open their data sockets on this interface only.
            "GLOO_SOCKET_IFNAME": interface,
            "NCCL_SOCKET_IFNAME": interface,
            # A gloo rank must never grab a GPU by accident; an nccl rank sees its own.
            "CUDA_VISIBLE_DEVICES": gpus[rank] if backend == "nccl" else "",
        }
        if check_collectives:
            # torch checks every collective's kind, shapes and dtypes across ranks before running it
            # (one more small collective each) and names the ranks that differ.
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env_per_rank.append(env)
    return RankPlan(
        backend=backend,
        ranks=ranks,
        threads_per_rank=threads_per_rank,
        check_collectives=check_collectives,
        gpus=gpus[:ranks] if backend == "nccl" else (),
        env_per_rank=tuple(env_per_rank),
    )
