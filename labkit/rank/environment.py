"""What a rank looks like to a program written for torchrun: its environment, backend and random state.

torchrun starts each process with variables that programs read (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, the ``TORCHELASTIC_*`` ones, ...)
and with its own random state. Ranks forked from the lab's process host would
all inherit the host's state: the same ``torch.initial_seed()`` everywhere, so
unseeded dropout or sampling would silently be identical on every rank. So each
rank draws fresh seeds from the operating system when it starts (and a replaced
rank when it is replaced), again before every script (a fresh process each time
under torchrun), and ``seed`` sets them reproducibly on request.

Runs in the engines; pure apart from setting ``os.environ`` and the generators.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import signal

import torch

# What torchrun gives every worker that changes how torch itself behaves: set only while a script
# runs, so that the lab's own groups (and cells, and training runs) keep torch's defaults. torchrun
# keeps a value the environment already has.
SCRIPT_ONLY_VARIABLES = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def torchrun_environment(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int | None = None,
                         local_world_size: int | None = None, host_index: int = 0, host_count: int = 1) -> dict[str, str]:
    """The variables torchrun sets for one process; by default every rank on one machine.

    ``master_addr`` is the rendezvous store's address: on loopback, it is named ``localhost``
    as ``torchrun --standalone`` names it."""
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    if _is_loopback(master_addr):
        master_addr = "localhost"
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
        # Empty, as under ``torchrun --log-dir /dev/null``: a script's ``@record`` writes no error file;
        # the lab reports the traceback itself.
        "TORCHELASTIC_ERROR_FILE": "",
        # The store at MASTER_ADDR:MASTER_PORT exists (the lab's): an ``env://`` rendezvous joins it.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }


def end_at_sigterm() -> None:
    """SIGTERM ends this rank at once, as it ends a torchrun worker (Python's default); main thread only.

    The ipyparallel engine stops gracefully instead: the work in hand (a script that terminated
    itself) still reported success, and the process stayed alive for a moment after, so a call made
    meanwhile went to a rank about to vanish ("rank 1 died"). Ended at once, the work is reported
    as terminated, and the process host sees the exit before the next call."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return address == "localhost"


@contextlib.contextmanager
def script_environment():
    """While a script runs: the variables torchrun gives a worker that the lab leaves out otherwise."""
    missing = [name for name in SCRIPT_ONLY_VARIABLES if name not in os.environ]
    os.environ.update({name: SCRIPT_ONLY_VARIABLES[name] for name in missing})
    try:
        yield
    finally:
        for name in missing:
            os.environ.pop(name, None)


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


def seed_as_asked(seeding: tuple[int, bool] | None, rank: int) -> int:
    """Seed as ``lab.seed`` last asked (``(value, same)``: ``value``, or ``value + rank``), or from the
    operating system's entropy when it was never asked; return the seed."""
    if seeding is None:
        return seed_independently()
    value, same = seeding
    used = value if same else value + rank
    seed_all(used)
    return used


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


def nccl_seconds(cell_seconds: float) -> float:
    """nccl's time limit for a cell limited to ``cell_seconds``: well past the lab's own path for a stuck
    cell (the limit, a moment for gloo's timeouts, an interrupt, then the rank released or replaced),
    since nccl's watchdog does not raise in the cell but ends the rank's process."""
    return 2 * cell_seconds + 60.0
