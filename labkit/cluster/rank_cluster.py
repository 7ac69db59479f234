"""The ipyparallel cluster behind a lab: one controller and one engine set per rank.

``RankCluster`` starts the process host, the controller and one engine per rank,
all bound to loopback and all inside a private working directory (mode 0700, so
connection files are readable by their owner only). It waits for the ranks with
a deadline, knows which engine and process is which rank, can signal or replace
a single rank, and on ``stop()`` leaves no process and no listening port behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time

import ipyparallel
import psutil
from IPython.core.profiledir import ProfileDir

from labkit.rank import entry as rank_entry
from labkit.cluster.placement import RankPlan
from labkit.cluster.workdir import WORKDIR_PREFIX, owner_only, remove_stale_workdirs, write_owner
from labkit.spec.errors import LabError, StartupError, describe_exit, format_ranks
from labkit.cluster.hosted.launchers import HostedControllerLauncher, HostedEngineLauncher
from labkit.cluster.hosted.host_client import HostError, ProcessHost

LOOPBACK = "127.0.0.1"
_ENGINE_STARTUP = "__import__('labkit.rank.entry').rank.entry.install()"
_LOG_TAIL_LINES = 15
HEARTBEAT_MS = 200


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            lines = log.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _gone(pid: int) -> bool:
    """Exited, even if its parent has not collected it yet (a zombie)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class RankCluster:
    """Controller, engines and process host of one lab; ranks addressable by id."""

    def __init__(self, plan: RankPlan, start_timeout: float = 60.0, logger: logging.Logger | None = None):
        self.plan = plan
        self.start_timeout = start_timeout
        self.log = logger or logging.getLogger("labkit.cluster")
        self.workdir: str | None = None
        self.host: ProcessHost | None = None
        self.cluster: ipyparallel.Cluster | None = None
        self.client: ipyparallel.Client | None = None
        self.engine_of: dict[int, int] = {}  # rank -> ipyparallel engine id
        self.pid_of: dict[int, int] = {}  # rank -> process id
        self.retired_engines: set[int] = set()  # engine ids of replaced ranks, maybe not yet unregistered
        self.capabilities: dict = {}

    # -- paths --------------------------------------------------------------

    @property
    def profile_dir(self) -> str:
        assert self.workdir is not None
        return os.path.join(self.workdir, "profile")

    @property
    def control_path(self) -> str:
        """The file through which the notebook asks ranks to stop or slow down (see instruments)."""
        assert self.workdir is not None
        return os.path.join(self.workdir, "control.json")

    def log_path(self, rank: int | None = None) -> str:
        name = "host.log" if rank is None else f"rank{rank}.log"
        return os.path.join(self.profile_dir, "log", name)

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
            if isinstance(error, (HostError, TimeoutError, OSError, RuntimeError)):
                raise StartupError(
                    f"the lab did not start within {self.start_timeout:g} s (start_timeout): "
                    f"{error or type(error).__name__}. Nothing was left running."
                ) from error
            raise

    def _start(self, deadline: float) -> None:
        remove_stale_workdirs()
        self.workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)  # mode 0700
        write_owner(self.workdir)
        ProfileDir.create_profile_dir(self.profile_dir)
        owner_only(self.workdir)
        self.host = ProcessHost(self.log_path()).start()
        self.cluster = ipyparallel.Cluster(
            profile_dir=self.profile_dir,
            controller_ip=LOOPBACK,
            controller_args=[
                "--nodb",
                "--log-level=WARN",
                # The hub admits an engine at its first heartbeat: a short period
                # makes a new rank usable in a fraction of a second, not ~3 s.
                f"--HeartMonitor.period={HEARTBEAT_MS}",
            ],
            controller_launcher_class=HostedControllerLauncher,
            engine_launcher_class=HostedEngineLauncher,
            delay=0,
            cluster_file="",
            shutdown_atexit=False,  # the Lab stops the cluster itself, host included
            log=self.log,
            engine_timeout=int(self.start_timeout),
        )
        self.cluster.start_controller_sync(host=self.host, spawn_timeout=self._left(deadline))
        self._check_capabilities(deadline)
        for rank in range(self.plan.ranks):
            self._start_rank(rank, deadline)
        self.client = self.cluster.connect_client_sync()
        self._wait_for_ranks(set(range(self.plan.ranks)), deadline)
        self.host.warm()  # while the first cells run: a rank that replaces one later starts warm

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.1, deadline - time.monotonic())

    def _check_capabilities(self, deadline: float) -> None:
        assert self.host is not None
        try:
            self.capabilities = self.host.capabilities.result(self._left(deadline))
        except TimeoutError:
            raise StartupError(
                f"torch did not finish importing within {self.start_timeout:g} s "
                f"(start_timeout); process host log:\n{_log_tail(self.log_path())}"
            ) from None
        except HostError:
            raise StartupError(
                "the process host could not import torch and ipyparallel; "
                f"its log says:\n{_log_tail(self.log_path())}"
            ) from None
        if self.plan.backend == "nccl" and not (self.capabilities["cuda_build"] and self.capabilities["nccl"]):
            raise StartupError(
                f"nccl was asked for, but this torch ({self.capabilities['torch']}) has no CUDA/nccl; "
                "install a CUDA build of torch or use backend='gloo'"
            )

    def _engine_args(self) -> list[str]:
        return [
            "--IPEngine.enable_nanny=False",  # one process per rank; the lab signals ranks itself
            f"--IPEngine.startup_command={_ENGINE_STARTUP}",
            "--log-level=WARN",
        ]

    def _start_rank(self, rank: int, deadline: float) -> None:
        assert self.cluster is not None
        self.cluster.start_engines_sync(
            n=1,
            engine_set_id=f"rank{rank}",
            host=self.host,
            spawn_timeout=self._left(deadline),
            environment={**self.plan.env_per_rank[rank], "LABKIT_CONTROL": self.control_path},
            engine_args=self._engine_args(),
            output_file=self.log_path(rank),
        )
        launcher = self.cluster.engines[f"rank{rank}"]
        self.pid_of[rank] = launcher.pid

    def _wait_for_ranks(self, ranks: set[int], deadline: float) -> None:
        """Wait until every rank in ``ranks`` has registered; map ranks to engine ids."""
        assert self.client is not None
        seen = set(self.engine_of.values()) | self.retired_engines
        waiting = set(ranks)
        while waiting:
            new_ids = [engine for engine in self.client.ids if engine not in seen]
            if new_ids:
                seen.update(new_ids)
                for engine in new_ids:
                    try:
                        info = self.client[engine].apply_sync(rank_entry.identity)
                    except Exception:  # an engine that died after registering
                        continue
                    if info["rank"] in waiting:
                        self.engine_of[info["rank"]] = engine
                        self.pid_of[info["rank"]] = info["pid"]
                        waiting.discard(info["rank"])
                continue
            dead = self._dead_ranks(waiting)
            if dead or time.monotonic() > deadline:
                raise StartupError(self._startup_failure(waiting, dead))
            time.sleep(0.02)

    def _dead_ranks(self, ranks) -> dict[int, int | None]:
        dead = {}
        for rank in ranks:
            pid = self.pid_of.get(rank)
            if pid is None:
                continue
            if self.host and pid in self.host.exit_codes:
                dead[rank] = self.host.exit_codes[pid]
            elif not psutil.pid_exists(pid):
                dead[rank] = None
        return dead

    def _startup_failure(self, missing: set[int], dead: dict[int, int | None]) -> str:
        lines = []
        if dead:
            codes = ", ".join(f"rank {r}: exit code {c}" for r, c in sorted(dead.items()))
            lines.append(f"{format_ranks(dead)} exited while starting ({codes})")
        slow = sorted(set(missing) - set(dead))
        if slow:
            lines.append(f"{format_ranks(slow)} did not register within {self.start_timeout:g} s (start_timeout)")
        for rank in sorted(missing)[:2]:
            tail = _log_tail(self.log_path(rank))
            if tail:
                lines.append(f"last lines of rank {rank}'s log:\n{tail}")
        lines.append("Nothing was left running. Try again with a longer start_timeout, or fewer ranks.")
        return "\n".join(lines)

    # -- addressing ranks ---------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        return sorted(self.engine_of)

    def engine(self, rank: int):
        """A view on one rank: its results come back as single values."""
        assert self.client is not None
        return self.client[self.engine_of[rank]]

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

    def condition(self, rank: int) -> str | None:
        """None while the rank can work; else why it cannot, in words (exited, frozen, lost)."""
        pid = self.pid_of.get(rank)
        if pid is None:
            return "has no process"
        if self.host and pid in self.host.exit_codes:
            return f"exited ({describe_exit(self.host.exit_codes[pid])})"
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            status = psutil.STATUS_ZOMBIE
        if status == psutil.STATUS_ZOMBIE:
            return f"exited ({describe_exit(self._exit_code(pid))})"
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return "was frozen (stopped by a signal such as SIGSTOP)"
        if self.client is not None and self.engine_of.get(rank) not in self.client.ids:
            return "was dropped by the controller (it missed its heartbeats)"
        return None

    def _exit_code(self, pid: int, wait: float = 3.0) -> int | None:
        """The code the host reports for an ended child, waiting a moment for the report to arrive
        (on a loaded machine the host's report can take more than a second)."""
        deadline = time.monotonic() + wait
        while self.host is not None and pid not in self.host.exit_codes and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.host.exit_codes.get(pid) if self.host is not None else None

    def is_alive(self, rank: int) -> bool:
        return self.condition(rank) is None

    def infrastructure_problem(self) -> str | None:
        """None while the process host and the controller run; else which one went, in words."""
        if self.host is None or self.host.process is None or self.host.process.poll() is not None:
            code = self.host.process.returncode if self.host and self.host.process else None
            return f"the lab's process host exited ({describe_exit(code)}), and every rank with it"
        controller = self.cluster.controller if self.cluster else None
        if controller is None or controller.pid is None:
            return "the lab's controller is not running"
        pid = controller.pid
        if pid in self.host.exit_codes or _gone(pid):
            return f"the lab's controller exited ({describe_exit(self._exit_code(pid))})"
        return None

    def broken_ranks(self) -> dict[int, str]:
        """Every rank that cannot work, with the reason."""
        return {rank: reason for rank in range(self.plan.ranks) if (reason := self.condition(rank)) is not None}

    def signal(self, ranks, signum: int = signal.SIGINT) -> None:
        for rank in ranks:
            pid = self.pid_of.get(rank)
            if pid is not None:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def replace(self, ranks, timeout: float | None = None) -> None:
        """Kill the given ranks' processes and start fresh ones in their place."""
        assert self.cluster is not None
        ranks = sorted(ranks)
        self.signal(ranks, signal.SIGKILL)
        for rank in ranks:
            engine_set = f"rank{rank}"
            if engine_set in self.cluster.engines:
                self.cluster.stop_engines_sync(engine_set)
            if rank in self.engine_of:
                self.retired_engines.add(self.engine_of.pop(rank))
        deadline = time.monotonic() + (timeout or self.start_timeout)
        for rank in ranks:
            self._start_rank(rank, deadline)
        self._wait_for_ranks(set(ranks), deadline)

    def listening_addresses(self) -> list[tuple[str, int, int]]:
        """(address, port, pid) of every listening TCP socket of the lab's processes."""
        pids = [pid for pid in (self.host.pid if self.host else None, *self.pid_of.values()) if pid]
        if self.cluster and self.cluster.controller and self.cluster.controller.pid > 0:
            pids.append(self.cluster.controller.pid)
        found = []
        for pid in pids:
            try:
                family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in family:
                try:
                    connections = process.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                for connection in connections:
                    if connection.status == psutil.CONN_LISTEN:
                        found.append((connection.laddr.ip, connection.laddr.port, process.pid))
        return sorted(set(found))

    def process_ids(self) -> list[int]:
        """Every process the lab started (host, controller, engines and their children)."""
        roots = [pid for pid in (self.host.pid if self.host else None,) if pid]
        found = set()
        for pid in roots:
            try:
                process = psutil.Process(pid)
                found.add(pid)
                found.update(child.pid for child in process.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return sorted(found)

    # -- stop ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop engines, controller and host; remove the working directory. Idempotent."""
        if self.client is not None:
            try:
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
        self.engine_of.clear()
        self.pid_of.clear()
        self.retired_engines.clear()
