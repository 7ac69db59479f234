"""The ipyparallel cluster behind a lab: one controller, engines from a launcher, engines that joined.

``RankCluster`` starts the process host and the controller on this machine, inside a private working
directory (mode 0700), bound to the lab's controller address (loopback unless the lab spans machines).
Engines come from the launcher the lab was given: the lab's own ("hosted": forked from the process host,
one engine set per rank, so one rank can be replaced alone) or one of ipyparallel's (MPI, SSH, Slurm, ...:
one engine set for the ranks started together). Engines started elsewhere by ``python -m labkit join``
wait in a pool and become ranks at the next start or heal.

As engines register, the cluster gives them ranks (``entry.become_rank``), numbered by host as
torchrun does; it signals a rank through ipyparallel (its launcher, or the nanny of engines started
elsewhere), tells why a rank cannot work (``cluster.health``), and on ``stop()`` leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time

import ipyparallel
from IPython.core.profiledir import ProfileDir

from labkit.cluster import engines, health
from labkit.cluster.engines import JOINED, RankRecord
from labkit.cluster.hosted.host_client import HostError, ProcessHost
from labkit.cluster.hosted.launchers import HostedControllerLauncher
from labkit.cluster.launchers import LauncherChoice, choose_launcher, signal_one_engine
from labkit.cluster.ssh_reach import ssh_reach_note
from labkit.cluster.joined_liveness import hear_from_joined, quiet_late_replies
from labkit.cluster.placement import RankPlan
from labkit.cluster.workdir import WORKDIR_PREFIX, owner_only, remove_stale_workdirs, write_owner
from labkit.spec.errors import LabError, StartupError, format_ranks
from labkit.wire.entry import STARTUP_COMMAND
from labkit.wire.rank_settings import RankSettings

HEARTBEAT_MS = 200
JOINED_SHUTDOWN_SECONDS = 3.0  # engines elsewhere that do not answer end by themselves (missed heartbeats)


class RankCluster:
    """Controller, engines and process host of one lab; ranks addressable by number."""

    def __init__(self, plan: RankPlan, start_timeout: float = 60.0, logger: logging.Logger | None = None,
                 launcher: LauncherChoice | None = None, encrypt: bool = False):
        self.plan = plan
        self.start_timeout = start_timeout
        self.launcher = launcher or choose_launcher()
        self.encrypt = encrypt
        self.log = logger or logging.getLogger("labkit.cluster")
        self.workdir: str | None = None
        self.host: ProcessHost | None = None
        self.cluster: ipyparallel.Cluster | None = None
        self.client: ipyparallel.Client | None = None
        self.records: dict[int, RankRecord] = {}
        self.retired_engines: set[int] = set()  # engines of replaced or dropped ranks, maybe not yet unregistered
        self.descriptions: dict[int, dict] = {}  # engine -> what it said it is (engines.describe asks once)
        self.capabilities: dict = {}
        self._settings: dict[int, RankSettings] = {}  # rank -> what it was told when it became one
        self._connection: dict | None = None  # the controller's engine connection info
        self.sets_started = 0
        self.phases: list[tuple[str, float]] = []  # (what was done, time.monotonic()) along start()

    # -- paths and addresses ------------------------------------------------------

    @property
    def profile_dir(self) -> str:
        assert self.workdir is not None
        return os.path.join(self.workdir, "profile")

    def log_path(self, rank: int | None = None) -> str:
        name = "host.log" if rank is None else f"rank{rank}.log"
        return os.path.join(self.profile_dir, "log", name)

    def engine_connection(self) -> dict:
        """What an engine needs to reach the controller (its connection file, read once: it holds)."""
        if self._connection is None:
            self._connection = engines.connection_info(self.profile_dir)
        return self._connection

    # -- start ----------------------------------------------------------------

    def start(self) -> None:
        """Start everything, or raise ``StartupError`` with nothing left running."""
        deadline = time.monotonic() + self.start_timeout
        try:
            self._start(deadline)
        except BaseException as error:
            self.stop()
            if isinstance(error, StartupError):
                raise
            # A plain Exception: what ipyparallel's launchers raise (ssh's "Unable to get remote shell information").
            if isinstance(error, (HostError, TimeoutError, OSError, RuntimeError)) or type(error) is Exception:
                raise StartupError(
                    f"the lab did not start within {self.start_timeout:g} s (start_timeout): "
                    f"{error or type(error).__name__}{ssh_reach_note(self.launcher)}. Nothing was left running."
                ) from error
            raise

    def _start(self, deadline: float) -> None:
        remove_stale_workdirs()
        self.workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)  # mode 0700
        write_owner(self.workdir)
        ProfileDir.create_profile_dir(self.profile_dir)
        owner_only(self.workdir)
        self.host = ProcessHost(self.log_path()).start()
        controller_args = [
            "--nodb",
            "--log-level=WARN",
            # The hub admits an engine at its first heartbeat: a short period
            # makes a new rank usable in a fraction of a second, not ~3 s.
            f"--HeartMonitor.period={HEARTBEAT_MS}",
        ]
        if self.encrypt:
            controller_args.append("--IPController.enable_curve=True")  # CurveZMQ on every socket
        self.cluster = ipyparallel.Cluster(
            profile_dir=self.profile_dir,
            controller_ip=self.plan.controller_address,
            controller_args=controller_args,
            controller_launcher_class=HostedControllerLauncher,
            engine_launcher_class=self.launcher.engine_class,
            config=self.launcher.config(),
            send_engines_connection_env=True,  # engines elsewhere need no file from this machine
            delay=0, cluster_file="",
            shutdown_atexit=False,  # the Lab stops the cluster itself, host included
            log=self.log, engine_timeout=int(self.start_timeout),
        )
        self.cluster.start_controller_sync(host=self.host, spawn_timeout=self._left(deadline))
        self._reached("controller started")
        if self.launcher.on_this_machine:
            self.capabilities = health.check_capabilities(self, self._left(deadline))
            self._reached("torch imported (process host)")
        self._launch(list(range(self.plan.ranks)), deadline)
        self.client = quiet_late_replies(self.cluster.connect_client_sync())
        engines = self._wait_for_engines(self.plan.ranks, deadline) + self._first_joiners(deadline)
        self._reached("engines registered")
        self._assign(engines, list(range(len(engines))), deadline)
        self._reached("ranks assigned")

    def _reached(self, what: str) -> None:
        self.phases.append((what, time.monotonic()))

    def warm_host(self) -> None:
        """Once the lab is ready (not before: it would slow the start), warm the host for replacements."""
        if self.host is not None:
            self.host.warm()

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.1, deadline - time.monotonic())

    def _engine_args(self) -> list[str]:
        return [
            # The lab's own engines are signalled through their launcher (one process each); engines
            # elsewhere through ipyparallel's nanny beside each, which also reports their exit at once.
            f"--IPEngine.enable_nanny={not self.launcher.hosted}",
            f"--IPEngine.startup_command={STARTUP_COMMAND}",
            "--log-level=WARN",
        ]

    def _launch(self, ranks: list[int], deadline: float, together: bool = True, places: dict | None = None) -> None:
        """Start engines for ``ranks``: one set each with the lab's launcher; with another, one set for all
        (``together``: a start) or one set each (a replacement: under MPI a set's engines ask for their MPI
        rank as engine id, which registered engines may hold; under ssh it goes to its rank's ``places``)."""
        if not ranks:
            return
        assert self.cluster is not None
        if self.launcher.hosted:
            for rank in ranks:
                # Started together, engines are numbered as their ranks; a replacement takes a fresh id.
                asked_id = [f"--IPEngine.id={rank}"] if together else []
                self.cluster.start_engines_sync(
                    n=1, engine_set_id=f"rank{rank}", host=self.host, spawn_timeout=self._left(deadline),
                    environment=self.plan.launch_environment(rank, f"rank{rank}"),
                    engine_args=[*self._engine_args(), *asked_id], output_file=self.log_path(rank))
            return
        for group in [ranks] if together else [[rank] for rank in ranks]:
            self.sets_started += 1
            engine_set = f"ranks{self.sets_started}"
            options = self.launcher.set_options(self.plan.launch_environment(None, f"set:{engine_set}"),
                                                self._engine_args(), self.log_path(group[0]),
                                                None if together else (places or {}).get(group[0]))
            self.cluster.start_engines_sync(n=len(group), engine_set_id=engine_set, **options)

    def _wait_for_engines(self, count: int, deadline: float) -> list[tuple[int, dict]]:
        return engines.wait_for_launched(self, count, deadline)

    def joiners(self) -> list[tuple[int, dict]]:
        """Engines that joined with ``python -m labkit join`` and wait to become ranks."""
        return engines.joiners(self)

    def _first_joiners(self, deadline: float) -> list[tuple[int, dict]]:
        """The engines that joined already; a lab of no ranks of its own (ranks=0) prints its join
        command and waits for the first machine to join, within start_timeout."""
        if self.plan.ranks > 0:
            return self.joiners()
        from labkit.cluster.join import join_command

        # The wait is what is left of start_timeout, which counts from the start of the lab: say both.
        left = max(0.0, deadline - time.monotonic())
        print(f"labkit: waiting for machines to join, for the {left:.1f} s left of start_timeout "
              f"({self.start_timeout:g} s from the start of the lab); run this on each:\n{join_command(self)}",
              flush=True)
        joined: list[tuple[int, dict]] = []
        while not joined and time.monotonic() < deadline:
            time.sleep(0.2)
            joined = self.joiners()
        return joined

    def _assign(self, found: list[tuple[int, dict]], ranks: list[int], deadline: float) -> None:
        self._settings.update(engines.assign(self, found, ranks, deadline))

    # -- addressing ranks ---------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.records)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.records)

    @property
    def engine_of(self) -> dict[int, int]:
        return {rank: record.engine for rank, record in self.records.items()}

    @property
    def pid_of(self) -> dict[int, int]:
        return {rank: record.pid for rank, record in self.records.items()}

    def engine(self, rank: int):
        """A view on one rank: its results come back as single values."""
        assert self.client is not None
        return self.client[self.records[rank].engine]

    def call(self, ranks, function, args, timeout: float) -> list:
        """``function(*args)`` on ``ranks``; results in order, or a LabError naming the rank that failed."""
        ranks = list(ranks)
        pending = [self.engine(rank).apply_async(function, *args) for rank in ranks]
        deadline = time.monotonic() + timeout
        while not all(result.ready() for result in pending) and time.monotonic() < deadline:
            time.sleep(0.005)
        results, stuck = [], []
        for rank, result in zip(ranks, pending):
            if not result.ready():
                stuck.append(rank)
                continue
            try:
                results.append(result.get(0))
            except Exception as error:
                what = f"{getattr(error, 'ename', type(error).__name__)}: {getattr(error, 'evalue', error)}"
                raise LabError(f"rank {rank} failed in {function.__name__}: {what}") from None
        if stuck:
            raise LabError(f"{format_ranks(stuck)} did not finish {function.__name__} within {timeout:g} s")
        return results

    # -- health, signals ---------------------------------------------------------

    def condition(self, rank: int) -> str | None:
        """None while the rank can work; else why it cannot, in words (exited, frozen, lost)."""
        return health.condition(self, rank)

    def is_alive(self, rank: int) -> bool:
        return self.condition(rank) is None

    def infrastructure_problem(self) -> str | None:
        return health.infrastructure_problem(self)

    def broken_ranks(self, ask_joined: bool = False) -> dict[int, str]:
        """Every rank that cannot work, with the reason; ``ask_joined``: joined ranks answer first (before a call)."""
        if ask_joined:
            hear_from_joined(self)
        return {rank: reason for rank in self.ranks if (reason := self.condition(rank)) is not None}

    def signal(self, ranks, signum: int = signal.SIGINT) -> None:
        """Send ``signum`` to ranks through ipyparallel: the launcher of a hosted rank, the nanny of others.

        The controller cannot reach an engine it dropped (frozen, or cut off): such a rank's whole
        engine set is signalled through its launcher when none of the set still works, and a process
        on this machine directly, so nothing frozen is left behind."""
        nanny = []
        for rank in ranks:
            record = self.records.get(rank)
            if record is None:
                continue
            if self.launcher.hosted and not record.joined:
                self._signal_set(record.engine_set, signum)
            elif self.client is not None and record.engine in self.client.ids:
                nanny.append(record.engine)
            else:
                self._signal_dropped(record, signum)
        if nanny and self.client is not None:  # engines go to the nanny only while there is a client
            try:
                self.client.send_signal(signum, targets=nanny, block=False)
            except Exception as error:  # noqa: BLE001 - dropped in the meantime: gone for the lab either way
                self.log.debug("signal %s to engines %s: %r", signum, nanny, error)

    def _signal_set(self, engine_set: str | None, signum: int) -> None:
        launcher = self.cluster.engines.get(engine_set) if self.cluster and engine_set else None
        if launcher is not None:
            with contextlib.suppress(Exception):  # it ended already
                launcher.signal(signum)

    def _signal_dropped(self, record: RankRecord, signum: int) -> None:
        together = [other for other in self.records.values() if other.engine_set == record.engine_set]
        if record.engine_set and all(self.client is None or other.engine not in self.client.ids
                                     for other in together):
            self._signal_set(record.engine_set, signum)
        if record.host == socket.gethostname() and not record.joined:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(record.pid, signum)
        elif self.cluster and record.engine_set:  # a host its launcher reaches (ssh, a Slurm job step)
            signal_one_engine(self.cluster.engines.get(record.engine_set), record, signum)

    def replace(self, ranks, timeout: float | None = None) -> None:
        """Kill the given ranks' processes and start fresh ones in their place (not for joined ranks)."""
        assert self.cluster is not None
        ranks = sorted(ranks)
        joined = [rank for rank in ranks if self.records[rank].joined]
        if joined:
            raise LabError(f"{format_ranks(joined)} joined from another machine: the lab cannot restart them "
                           "(drop them with a heal, or run the join command there again)")
        self.signal(ranks, signal.SIGKILL)
        retired = {rank: self.records.pop(rank) for rank in ranks}
        for record in retired.values():  # a set none of the ranks left uses is stopped
            self.retired_engines.add(record.engine)
            if record.engine_set in self.cluster.engines and record.engine_set not in {
                    other.engine_set for other in self.records.values()}:
                self.cluster.stop_engines_sync(record.engine_set)
        deadline = time.monotonic() + (timeout or self.start_timeout)
        self._launch(ranks, deadline, together=False, places={rank: r.launched_on for rank, r in retired.items()})
        self._assign(self._wait_for_engines(len(ranks), deadline), ranks, deadline)

    def resize(self, dropped, joining: list[tuple[int, dict]], timeout: float | None = None) -> None:
        """Drop the ranks ``dropped`` (joined ranks that were lost) and add the ``joining`` engines after the
        rest; the ranks are numbered 0.. again, in their old order."""
        self.signal(dropped, signal.SIGKILL)  # if it can still be reached, it must not linger as a rank
        for rank in dropped:
            self.retired_engines.add(self.records.pop(rank).engine)
        self.records = {new: self.records[old] for new, old in enumerate(sorted(self.records))}
        deadline = time.monotonic() + (timeout or self.start_timeout)
        first = len(self.records)
        self._assign(joining, list(range(first, first + len(joining))), deadline)

    def store_address(self, host: str, port: int) -> tuple[str, int]:
        """Where the notebook reaches rank 0's store at ``host:port`` (here: there; a site: through its line)."""
        return host, port

    def place_of(self, rank: int) -> dict[str, object]:
        """What this rank was told when it became one (its world, host layout, controller)."""
        return dict(self._settings.get(rank, {}))

    def listening_addresses(self) -> list[tuple[str, int, int]]:
        """(address, port, pid) of every listening TCP socket of the lab's processes on this machine."""
        return health.listening_addresses(self)

    def process_ids(self) -> list[int]:
        """Every process the lab started on this machine (host, controller, engines and their children)."""
        return health.process_ids(self)

    # -- stop ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop engines, controller and host; remove the working directory. Idempotent. Engines that
        joined from elsewhere are asked to shut down (their join command ends with them)."""
        if self.client is not None:
            joined = [record.engine for record in self.records.values() if record.joined]
            joined += [engine for engine, _ in self.joiners()]
            try:
                if joined:
                    self.client.shutdown(targets=joined, block=False)
                    # The request leaves on the client's own thread: wait (briefly) until they unregister.
                    deadline = time.monotonic() + JOINED_SHUTDOWN_SECONDS
                    while set(joined) & set(self.client.ids) and time.monotonic() < deadline:
                        time.sleep(0.05)
                self.client.close()
            except Exception:
                pass
            self.client = None
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            try:
                cluster.stop_cluster_sync()
            except Exception as error:  # the host below ends whatever is left
                self.log.debug("stopping the ipyparallel cluster: %r", error)
        if self.host is not None:
            host, self.host = self.host, None
            host.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        self.records.clear()
        self.retired_engines.clear()
        self.descriptions.clear()
        self._connection = None
