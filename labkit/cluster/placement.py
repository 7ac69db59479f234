"""Which backend and which device each rank gets, decided before anything starts.

Pure logic plus cheap probes (``visible_gpus``, the machine's addresses); it
never imports torch, so the notebook can refuse a bad request in milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from labkit.spec.errors import LabConfigError
from labkit.spec.network import LOOPBACK_ADDRESS, address_of, check_ipv4, interface_of
from labkit.wire.gpus import gpu_index, visible_gpus
from labkit.wire.rank_settings import RankSettings

BACKENDS = ("gloo", "nccl")
# What one rank needs of the machine. Measured on the 2-core development machine (gloo, torch
# 2.13): a rank forked from the process host holds about 90 MB of its own at start (its
# unique set, USS) and about 150 MB after a small training run, besides pages it shares with
# the host; 200 MB leaves room for the user's own tensors in a workshop.
RANK_MEMORY_BYTES = 200 * 10**6
MEMORY_SHARE = 0.8  # of what is free: the notebook and everything else need the rest
RANKS_PER_CORE = 16  # past this, ranks queue for the cores long enough to time out collectives
# Bounds past any real lab, so that a slip of the keyboard (ranks=10**9 with oversubscribe=True,
# threads_per_rank=10**6) is refused at once instead of failing deep inside a start.
MAX_RANKS_HERE = 1024  # processes on this machine, even oversubscribed
MAX_RANKS = 65536  # across machines, with another launcher
MAX_THREADS_PER_RANK = 1024


class DeviceError(LabConfigError):
    """The requested backend or rank count does not fit the devices this machine has."""


@dataclass(frozen=True)
class RankPlan:
    """How every rank of a lab is placed: backend, threads, network, and each rank's settings."""

    backend: str
    ranks: int  # how many the launcher starts; engines that join add to them
    threads_per_rank: int | None  # None: each rank's host decides (its cores over its ranks)
    check_collectives: bool = False
    gpus: tuple[str, ...] = ()  # on this machine: the GPU each rank is pinned to
    controller_address: str = LOOPBACK_ADDRESS
    interface: str | None = None  # None: each rank uses the interface that reaches the controller
    ranks_per_host: int | None = None
    on_this_machine: bool = True

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def describe(self) -> str:
        where = "" if self.controller_address == LOOPBACK_ADDRESS else f", controller at {self.controller_address}"
        if self.backend == "nccl":
            gpus = f" ({', '.join(self.gpus)})" if self.gpus else ""
            return f"{self.ranks} ranks, nccl, one GPU each{gpus}{where}"
        checked = ", collectives checked" if self.check_collectives else ""
        threads = "" if self.threads_per_rank is None else f", {self.threads_per_rank} thread(s) each"
        return f"{self.ranks} ranks, gloo on CPU{threads}{checked}{where}"

    def launch_environment(self, rank: int | None, slot: str) -> dict[str, str]:
        """What a launched engine's environment carries: how it came, and on this machine its GPU.

        ``rank``: the rank an engine of the lab's own launcher will become (None for other launchers)."""
        env = {"LABKIT_SLOT": slot}
        if self.on_this_machine and rank is not None:
            # A gloo rank must never grab a GPU by accident. nccl ranks see the lab's GPUs, as under
            # torchrun, and each takes the LOCAL_RANK-th: a script's set_device(LOCAL_RANK) works.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus) if self.backend == "nccl" else ""
        return env

    def settings(self, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 host_index: int, host_count: int, controller_ports: Iterable[int] = ()) -> RankSettings:
        """Everything an engine needs to become ``rank`` (``labkit.wire.entry.become_rank``)."""
        threads = self.threads_per_rank
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
        return RankSettings(
            rank=rank,
            world_size=world_size,
            backend=self.backend,
            threads=threads,
            check_collectives=self.check_collectives,
            controller_address=self.controller_address,
            interface=self.interface,
            controller_ports=sorted(controller_ports),
            local_rank=local_rank,
            local_world_size=local_world_size,
            host_index=host_index,
            host_count=host_count,
        )


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
    oversubscribe: bool = False,
    available_memory: int | None = None,
    check_collectives: bool = False,
    controller_address: str | None = None,
    interface: str | None = None,
    ranks_per_host: int | None = None,
    on_this_machine: bool = True,
) -> RankPlan:
    """Check a request against the machine and decide how ranks are placed.

    With GPUs visible the default is nccl, one rank per GPU; without them gloo on
    CPU. Asking for nccl without GPUs, for more nccl ranks than GPUs, or for more
    ranks than the machine's memory and cores hold (unless ``oversubscribe``)
    raises ``DeviceError`` with what to do instead. Ranks started elsewhere (a
    launcher other than the lab's own, ``on_this_machine=False``) are checked
    where they start: this machine's GPUs, cores and memory do not limit them.
    """
    # The checks run in this order, so a request wrong in several ways is told the same first thing.
    check_request(ranks, oversubscribe, check_collectives, ranks_per_host, on_this_machine)
    controller_address = check_network(ranks, controller_address, interface, on_this_machine)
    gpus = (visible_gpus() if on_this_machine else ()) if gpus is None else tuple(gpus)
    backend = choose_backend(backend, gpus)
    if backend == "nccl" and on_this_machine:
        check_gpus(ranks, gpus)
    cpu_count = cpu_count or os.cpu_count() or 1
    threads_per_rank = threads_here(ranks, threads_per_rank, cpu_count, oversubscribe, available_memory,
                                    on_this_machine)
    return RankPlan(
        backend=backend,
        ranks=ranks,
        threads_per_rank=threads_per_rank,
        check_collectives=check_collectives,
        gpus=gpus[:ranks] if backend == "nccl" else (),
        controller_address=controller_address,
        interface=interface,
        ranks_per_host=ranks_per_host,
        on_this_machine=on_this_machine,
    )


def check_request(ranks: int, oversubscribe: bool, check_collectives: bool, ranks_per_host: int | None,
                  on_this_machine: bool) -> None:
    """Refuse a request malformed in itself, whatever the machine: the rank count, the flags, ``ranks_per_host``."""
    most_ranks = MAX_RANKS_HERE if on_this_machine else MAX_RANKS
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 0 <= ranks <= most_ranks:
        where = "on this machine" if on_this_machine else "with this launcher"
        raise DeviceError(f"ranks must be a whole number >= 0 and at most {most_ranks} {where} (0: only engines "
                          f"that join), got {ranks!r}")
    for name, flag in (("oversubscribe", oversubscribe), ("check_collectives", check_collectives)):
        if not isinstance(flag, bool):
            raise DeviceError(f"{name} is True or False, got {flag!r}")
    if ranks_per_host is not None and (isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int)
                                       or ranks_per_host < 1):
        raise DeviceError(f"ranks_per_host must be a positive integer (GPUs per host for nccl), got {ranks_per_host!r}")
    if ranks_per_host is not None and on_this_machine and ranks > ranks_per_host:
        # This launcher puts every rank on this one host: the layout is known before anything starts.
        raise DeviceError(f"host {_this_host()} would have {ranks} ranks, ranks_per_host is {ranks_per_host}: this "
                          "launcher starts every rank on this machine; ask for at most "
                          f"{ranks_per_host} ranks, raise ranks_per_host, or use a launcher that spreads them")


def check_network(ranks: int, controller_address: str | None, interface: str | None, on_this_machine: bool) -> str:
    """The controller's address (loopback unless given), refused unless this machine has it; ``interface`` too."""
    controller_address = LOOPBACK_ADDRESS if controller_address is None else check_ipv4(controller_address,
                                                                                         "controller_address")
    interface_of(controller_address)  # the controller listens there: it must be this machine's
    if ranks == 0 and controller_address == LOOPBACK_ADDRESS:
        raise DeviceError("ranks must be at least 1: a lab of 0 ranks here is only for engines that join from other "
                          "machines, which needs controller_address set to this machine's address they reach")
    if interface is not None and on_this_machine:
        address_of(interface)  # a name this machine does not have is refused now
    return controller_address


def choose_backend(backend: str | None, gpus: tuple[str, ...]) -> str:
    """The backend asked for, in lower case, or by default nccl where there are GPUs and gloo where not."""
    if backend is None:
        backend = "nccl" if gpus else "gloo"
    if not isinstance(backend, str):
        raise DeviceError(f"backend is a name, one of {', '.join(BACKENDS)} (or None to choose), got {backend!r}")
    backend = backend.lower()
    if backend not in BACKENDS:
        raise DeviceError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def check_gpus(ranks: int, gpus: tuple[str, ...]) -> None:
    """Refuse nccl ranks on this machine beyond its GPUs (``gpus``): it runs one rank per GPU."""
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


def threads_here(ranks: int, threads_per_rank: int | None, cpu_count: int, oversubscribe: bool,
                 available_memory: int | None, on_this_machine: bool) -> int | None:
    """Each rank's threads, once the machine's cores and memory are known to hold the ranks.

    On this machine, unless ``oversubscribe``: no more ranks than its memory and cores hold, and
    by default its cores shared among the ranks. Elsewhere None stays None: each rank's host decides."""
    if on_this_machine and not oversubscribe:
        check_capacity(ranks, cpu_count, _available_memory() if available_memory is None else available_memory)
    if threads_per_rank is None and on_this_machine:
        threads_per_rank = max(1, cpu_count // max(1, ranks))
    check_threads(threads_per_rank, cpu_count if on_this_machine and not oversubscribe else None)
    return threads_per_rank


def check_threads(threads_per_rank: object, cores: int | None) -> None:
    """Refuse a thread count no rank can use: not a whole number, below 1, or above the cores it runs on
    (``cores``; None where they are not known here, or oversubscribing: then only the absolute bound)."""
    most = MAX_THREADS_PER_RANK if cores is None else min(cores, MAX_THREADS_PER_RANK)
    if threads_per_rank is None:
        return
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or not 1 <= threads_per_rank <= most:
        beyond = (f" (this machine's cores; more threads than cores only slow a rank down, or pass "
                  f"oversubscribe=True for up to {MAX_THREADS_PER_RANK})" if cores is not None else "")
        raise DeviceError(f"threads_per_rank must be a whole number from 1 to {most}{beyond}, got {threads_per_rank!r}")


def _this_host() -> str:
    import socket

    return socket.gethostname()


def host_layout(hosts: list[str]) -> list[tuple[int, int, int, int]]:
    """For ranks living on ``hosts`` (one host name per rank, in rank order): each rank's
    (local_rank, local_world_size, host_index, host_count), as torchrun numbers them."""
    order = list(dict.fromkeys(hosts))  # hosts by their first rank
    seen: dict[str, int] = {}
    layout = []
    for host in hosts:
        local = seen.get(host, 0)
        seen[host] = local + 1
        layout.append((local, hosts.count(host), order.index(host), len(order)))
    return layout


def check_host_places(backend: str, hosts: list[str], gpus_seen: list[int], ranks_per_host: int | None,
                      gpu_ids: list[tuple[str, ...] | None] | None = None) -> None:
    """Refuse a world the ranks cannot run in, before any of them is told its place.

    ``hosts``, ``gpus_seen`` and ``gpu_ids`` hold every rank of the world, old and new, in rank order:
    a rank's local number, and so its GPU, depends on every rank before it on its host, whoever
    launched them. ``gpu_ids``: the GPUs each rank's process sees, as its engine names them
    (``entry.describe_engine``), or None for a rank whose engine did not say (an older labkit).
    Refused: more ranks on a host than ``ranks_per_host``; for nccl, two ranks on a host that would
    use the same GPU (nccl refuses that deep inside the first collective), or a rank whose GPU
    (``gpu_index``) is past those its own process sees. A host with a rank of unknown GPUs is also
    held to the count rule: no more ranks than the most GPUs any of its engines shows.
    """
    local_ranks = [local for local, *_ in host_layout(hosts)]
    known: list[tuple[str, ...] | None] = [None] * len(hosts) if gpu_ids is None else gpu_ids
    on_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        on_host.setdefault(host, []).append(rank)
    for host, ranks in on_host.items():
        if ranks_per_host is not None and len(ranks) > ranks_per_host:
            raise DeviceError(f"host {host} has {_count(len(ranks), 'rank')} ({_rank_list(ranks)}), ranks_per_host "
                              f"is {ranks_per_host}: start fewer ranks there (the launcher's own options place them) "
                              "or raise ranks_per_host")
        if backend != "nccl":
            continue
        if any(known[rank] is None for rank in ranks):
            _check_by_count(host, ranks, local_ranks, gpus_seen)
        # Ranks that named their GPUs are checked by the GPU each will use, even beside one that did not.
        named = {rank: seen for rank in ranks if (seen := known[rank]) is not None}
        _check_by_identity(host, named, local_ranks, len(ranks))


def _check_by_count(host: str, ranks: list[int], local_ranks: list[int], gpus_seen: list[int]) -> None:
    """The rule for engines that report only how many GPUs they see: a rank per GPU the host shows.

    It cannot tell engines shown each its own GPU from engines sharing one, so it refuses both."""
    # The most any of its engines shows: an engine narrowed by CUDA_VISIBLE_DEVICES sees fewer.
    gpus = max(gpus_seen[rank] for rank in ranks)
    if len(ranks) > gpus:
        raise DeviceError(f"host {host} shows {_count(gpus, 'GPU')} and {_count(len(ranks), 'rank')} would be "
                          f"placed there ({_rank_list(ranks)}): nccl runs one rank per GPU. Start at most "
                          f"{_count(gpus, 'rank')} there (stop the extra engines, or join from a host with a free "
                          "GPU), or use backend='gloo'")
    for rank in ranks:
        local, shown = local_ranks[rank], gpus_seen[rank]
        # The engine reported what it sees, not whether CUDA_VISIBLE_DEVICES narrowed it; the two differ
        # only for a host of one GPU left unnarrowed, and that host holds local rank 0 alone (above).
        if gpu_index(local, shown) >= shown:
            raise DeviceError(f"rank {rank} would be rank {local} on host {host} and use cuda:{local}, but its "
                              f"process sees {_count(shown, 'GPU')} (host {host} shows {_count(gpus, 'GPU')}, "
                              f"{_count(len(ranks), 'rank')} placed there): give every engine on a host the same "
                              "CUDA_VISIBLE_DEVICES, or each its own single GPU")


def _check_by_identity(host: str, named: dict[int, tuple[str, ...]], local_ranks: list[int], placed: int) -> None:
    """The rule for engines that name their GPUs: each rank's own GPU, no two ranks of ``host`` on one.

    ``named``: rank -> the GPUs its process sees, in CUDA's order; ``placed``: every rank on the host."""
    taken: dict[str, tuple[int, int]] = {}  # GPU -> (the rank using it, its cuda index there)
    for rank, seen in named.items():
        local = local_ranks[rank]
        # As for counts, a process seeing one GPU is taken as narrowed to it; were it a host of one GPU
        # left unnarrowed, a second rank there would pick that same GPU here and be refused below, as it
        # must be (it would ask for cuda:1, which is not there).
        index = gpu_index(local, len(seen))
        if index >= len(seen):
            listed = f" ({', '.join(seen)})" if seen else ""
            raise DeviceError(f"rank {rank} would be rank {local} on host {host} and use cuda:{index}, but its "
                              f"process sees {_count(len(seen), 'GPU')}{listed} (host {host} holds "
                              f"{_count(placed, 'rank')}): show every engine there the same CUDA_VISIBLE_DEVICES with "
                              "a GPU per rank, or each engine its own single GPU, or start fewer ranks there")
        gpu = seen[index]
        # GPUs are compared as written. CUDA_VISIBLE_DEVICES may name one by index ("1") or by UUID
        # ("GPU-…", "MIG-…"), and which index a UUID is cannot be known without asking the driver: the
        # same GPU spelled both ways on one host reads as two GPUs and is not refused here. An engine
        # not narrowed names its GPUs "0".."n-1", CUDA's own indexes, which compare with indexes listed.
        if gpu in taken:
            other, other_index = taken[gpu]
            raise DeviceError(f"ranks {other} and {rank} on host {host} would both use GPU {gpu} (rank {other} "
                              f"as its cuda:{other_index}, rank {rank} as its cuda:{index}): nccl runs one rank "
                              f"per GPU. Show each engine on host {host} a GPU of its own (CUDA_VISIBLE_DEVICES, "
                              "or the scheduler's one GPU per task), start fewer ranks there, or use "
                              "backend='gloo'")
        taken[gpu] = (rank, index)


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)
