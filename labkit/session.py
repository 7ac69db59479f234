"""``Session``: the one owner of a lab's ranks.

It holds the processes (a ``RankCluster``), the process group's generation, the
mesh, the control channel and the busy lock, and it is the only code that
changes them. Everything the notebook does with ranks goes through it:

- ``execute`` sends user work and returns every rank's report, or recovers the
  lab and raises one failure (``failure`` is the single place that turns failed
  work into ``RankFailure`` / ``RankTimeout`` / ``RankInterrupted``);
- ``call`` runs the lab's own entry points (rendezvous, mesh) within a limit;
- ``begin`` / ``failure`` let a long run (``runs.training_run``) watch its work
  while it goes, after ``claim`` made the ranks its own (a ``runs.holder.RunHolder``).

``Lab`` is a thin facade over a session; the features in ``labkit.runs`` take a
session. No torch here: the ranks' code is reached through ``labkit.wire.entry``.
"""

from __future__ import annotations

import atexit
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from labkit.cluster.control import ControlRequests
from labkit.cluster.launchers import LauncherChoice, choose_launcher
from labkit.cluster.placement import RankPlan
from labkit.cluster.rank_cluster import RankCluster
from labkit.runs.dispatch import RankWork, make_output
from labkit.runs.healing import Interrupted, TrainingRecord
from labkit.runs.holder import RunHolder
from labkit.runs.notebook_process import NotebookProcess
from labkit.runs.recovery import dropped_notes, recover, split_broken, stale_reason, unusable_note, with_kept_logs
from labkit.runs.sources import notebook_sources
from labkit.spec.call_arguments import chosen_ranks
from labkit.wire import entry
from labkit.spec.errors import (LabBusy, LabConfigError, LabError, LabNotRunning, RankFailure, RankInterrupted,
                                RankTimeout, format_ranks)
from labkit.spec.link import LinkSpec
from labkit.spec.mesh import MeshSpec
from labkit.spec.train_config import TrainConfig
from labkit.units import positive_seconds
from labkit.views.rank_output import LiveOutput
from labkit.wire.schema import RankReport


def _stop_at_exit(session_ref: weakref.ref[Session]) -> None:
    session = session_ref()
    if session is not None:
        session.stop()


class Session:
    """The ranks of one lab and everything that must change together with them."""

    def __init__(self, plan: RankPlan, timeout: float, start_timeout: float, interrupt_grace: float,
                 launcher: LauncherChoice | None = None, encrypt: bool = False,
                 make_cluster: Callable[[], RankCluster] | None = None) -> None:
        self.plan = plan
        self.make_cluster = make_cluster  # a site's ranks (cluster.site_cluster); None: a controller of its own
        self.on_stop: list[Callable[[], None]] = []  # what ends with the ranks (the lab's line, its sites)
        self.launcher = launcher or choose_launcher()
        self.encrypt = encrypt
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.interrupt_grace = interrupt_grace
        self.cluster: RankCluster | None = None
        self.generation = 0
        self.mesh_spec: MeshSpec | None = None
        self.started_seconds: float | None = None
        self.start_phases: list[tuple[str, float]] = []  # (part of the start, seconds from its beginning)
        self.control = ControlRequests()
        self.notebook = NotebookProcess()  # user work runs in its folder, umask and environment changes
        # The simulated slow link (a spec.link.LinkSpec, lab.link), kept like the mesh: every group formed gets it.
        self.link: LinkSpec | None = None
        self.last_training: TrainingRecord | None = None  # what the ranks' TrainState holds
        self.said: set[str] = set()  # notes the user has been told once and need not read again
        self.interrupted: Interrupted | None = None  # the last run, when it failed before its end
        self.last_failure: RankFailure | None = None  # the last failed work (%lab debug starts at a rank that raised)
        self._holder: RunHolder | None = None  # long work that owns the ranks (a TrainingRun, a TaskQueue)
        self.foreground: RankWork | None = None  # the work a call (a cell, lab.run) waits for now: lab.status shows it
        self._holder_lock = threading.Lock()
        self._atexit: Callable[[], None] | None = None

    @property
    def world_size(self) -> int:
        """The ranks now: those the launcher started, and those that joined, less those lost."""
        return self.cluster.world_size if self.cluster is not None else self.plan.ranks

    @property
    def running(self) -> bool:
        return self.cluster is not None

    # -- start / stop ---------------------------------------------------------

    def start(self) -> None:
        if self.cluster is not None:
            if self.cluster.infrastructure_problem() is None and self.busy_with is None:
                self.heal()  # a running lab is reused, its broken ranks replaced
                return
            self.stop()
        began = time.monotonic()
        self.start_phases = []
        self.notebook = NotebookProcess()  # the environment the ranks start with: changes are counted from here
        cluster = self.make_cluster() if self.make_cluster else RankCluster(
            self.plan, start_timeout=self.start_timeout, launcher=self.launcher, encrypt=self.encrypt)
        cluster.start()
        if cluster.world_size == 0:
            cluster.stop()
            raise LabConfigError("the lab has no ranks: ranks=0 waits for engines that join, and none has; run "
                                 "the join command on another machine first, or start ranks here (ranks=N)")
        self.cluster = cluster
        self.control = ControlRequests()
        self._atexit = lambda ref=weakref.ref(self): _stop_at_exit(ref)
        atexit.register(self._atexit)
        try:
            self.form_group()
            formed = time.monotonic()
            self.check_group()
        except BaseException:
            self.stop()
            raise
        self.started_seconds = time.monotonic() - began
        # How long each part of the start took (bench/startup.py prints them).
        marks = [*cluster.phases, ("process group formed", formed), ("first all-reduce", began + self.started_seconds)]
        self.start_phases = [(what, at - began) for what, at in marks]
        cluster.warm_host()

    def stop(self) -> None:
        holder = self._holder
        if holder is not None and not holder.done:
            holder.stop()  # let a background run end at a step boundary before the ranks go
            holder.finished(10)
        self._holder = None  # whatever held the ranks, they are gone
        while self.on_stop:
            self.on_stop.pop()()
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.stop()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        self.generation = 0
        self.last_training = None
        self.control = ControlRequests()

    def remember_training(self, config: TrainConfig, steps_done: int) -> None:
        """The ranks now hold a training state of ``config`` after ``steps_done`` steps."""
        self.last_training = TrainingRecord(config, steps_done, self.generation)
        self.interrupted = None

    def remember_interrupted(self, interrupted: Interrupted) -> None:
        """A run failed before its end (``runs.healing.Interrupted``): ``lab.heal()`` may finish it."""
        self.interrupted = interrupted

    # -- who may use the ranks ------------------------------------------------

    def require_running(self) -> RankCluster:
        if self.cluster is None:
            raise LabNotRunning("the lab is not running: call lab.start() (or %lab start) first")
        return self.cluster

    def require_idle(self) -> RankCluster:
        cluster = self.require_running()
        holder = self._holder
        if holder is not None and not holder.done:
            raise LabBusy(f"a training run is in progress ({holder.status()}): "
                          "wait for it (run.wait()) or stop it (run.stop(), or its Stop button) first")
        return cluster

    def claim(self, holder: RunHolder) -> None:
        """Make the ranks ``holder``'s until ``release``: other work is refused with ``LabBusy``."""
        with self._holder_lock:
            self.require_idle()
            self._holder = holder

    def release(self, holder: RunHolder) -> None:
        with self._holder_lock:
            if self._holder is holder:
                self._holder = None

    @property
    def busy_with(self) -> str | None:
        """What holds the ranks now, in words (None when they are free)."""
        holder = self._holder
        return holder.status() if holder is not None and not holder.done else None

    # -- work -------------------------------------------------------------------

    def limit(self, timeout: float | None) -> float:
        try:  # units sits below the lab's errors: said as the lab's own, in one line
            return self.timeout if timeout is None else positive_seconds("timeout", timeout)
        except ValueError as error:
            raise LabConfigError(str(error)) from None

    def targets(self, ranks) -> list[int]:
        """The ranks ``ranks`` names (None: all, a rank number, or a list of them), checked against the world."""
        return chosen_ranks(ranks, self.world_size)

    def begin(self, ranks: list[int], work_entry: Callable, args: tuple, limit: float, output: LiveOutput,
              on_tick: Callable[[RankWork], None] | None = None,
              on_interrupt: Callable[[], float] | None = None) -> RankWork:
        """Start ``work_entry(*args, limit)`` on ``ranks``; the caller waits and checks ``failure``."""
        cluster = self.require_running()
        try:
            return RankWork(cluster, ranks, work_entry, (*args, limit), timeout=limit,
                            interrupt_grace=self.interrupt_grace, output=output, on_tick=on_tick,
                            on_interrupt=on_interrupt, notebook=self.notebook, store_address=self.control.address)
        except (TypeError, AttributeError, pickle.PicklingError) as error:
            # Sending pickles the function and its arguments; nothing reached a rank that could run.
            raise LabConfigError(
                f"the work could not be sent to the ranks: {error}. A function and its arguments travel to each "
                "rank pickled: pass plain data (numbers, strings, lists, dicts, tensors), and make locks, open "
                "files, sockets or clients on the ranks instead"
            ) from None

    def failure(self, work: RankWork, reports: dict[int, RankReport], limit: float) -> LabError:
        """Failed work as the exception to raise, after bringing the lab back for the next call."""
        try:
            recovery = self.recover(work, reports)
        except LabError as error:
            recovery = f"The process group could not be rebuilt ({error}); call lab.restart() (or %lab restart)."
        kind = RankInterrupted if work.interrupted else RankTimeout if work.timed_out else RankFailure
        self.last_failure = kind(reports, timed_out=work.timed_out, timeout_seconds=limit, interrupted=work.interrupted,
                                 replaced=tuple(work.replaced), recovery=recovery, deadlock=work.deadlock or "")
        return self.last_failure

    def ready(self) -> RankCluster:
        """Idle ranks that can all work: a rank that died, froze or was dropped since the last
        call is replaced first (``heal``)."""
        cluster = self.require_idle()
        self.heal()
        return cluster

    def heal(self) -> str | None:
        """Replace every rank that cannot work (a frozen one is killed first), let waiting engines join,
        rebuild the group; say so. The other ranks keep their namespaces. A lost rank that joined from
        another machine, or whose ssh host no longer answers, is dropped, the ranks after it renumbered.
        The note printed, or None."""
        cluster = self.require_running()
        problem = cluster.infrastructure_problem()
        if problem:
            raise LabError(f"{problem}: the lab cannot go on; call lab.restart() (or %lab restart) for fresh ranks")
        broken = cluster.broken_ranks(ask_joined=True)  # a frozen joined rank: dropped before the call
        joining = cluster.joiners()
        if not broken and not joining:
            return None
        try:
            note, _ = self.repair(cluster, broken, joining)
        except Exception as error:  # noqa: BLE001 - whatever stops the repair, the way out is a restart
            raise LabError(f"{format_ranks(broken) if broken else 'the lab'} could not be repaired ({error}); "
                           "call lab.restart() (or %lab restart)") from None
        print(note, flush=True)
        return note

    def repair(self, cluster: RankCluster, broken: dict[int, str], joining: list, reason: str = "") -> tuple[str, dict]:
        """Replace or drop ``broken`` ranks, adopt ``joining`` engines, form the group; the note to show, and
        by rank the variables that held objects built on the groups of before (now unusable).
        ``reason``: what the process groups of before say when used again (a default names the change)."""
        dropped, replaced, cut_off = split_broken(cluster, broken)
        kept = [rank for rank in cluster.ranks if rank not in broken]  # these keep their namespaces
        broken = with_kept_logs(cluster, broken, replaced)  # before their replacements write to the same names
        parts = [f"rank {rank} {reason}" for rank, reason in sorted(broken.items())]
        if replaced:
            cluster.replace(replaced)
            parts.append(f"replaced {format_ranks(replaced)} with fresh processes")
        if dropped or joining:
            hosts = sorted({info["host"] for _, info in joining})
            cluster.resize(dropped, joining)
            parts.extend(dropped_notes(dropped, cut_off))
            if joining:
                parts.append(f"{len(joining)} engine(s) joined from {', '.join(hosts)}")
            parts.append(f"the lab now has {self.world_size} ranks")
            self.control.forget_ranks_from(self.world_size)
            if self.mesh_spec is not None and self.mesh_spec.world_size != self.world_size:
                parts.append(f"the mesh {self.mesh_spec.describe()} no longer fits and was dropped "
                             "(set one with lab.mesh)")
                self.mesh_spec = None
        held = self.form_group(reason or stale_reason(self.generation, replaced, dropped, len(joining)))
        # Say that variables were kept only where some rank kept them.
        namespaces = ("the other ranks kept their variables" if kept else
                      "no rank kept its variables: every rank is a fresh process with an empty namespace")
        unusable = unusable_note(held)
        return (f"labkit: {'; '.join(parts)}. The process groups were formed anew (generation {self.generation}); "
                f"{namespaces}{'; ' + unusable if unusable else ''}."), held

    def kill(self, rank) -> str:
        """SIGKILL ``rank``'s process, busy or not; say which."""
        cluster = self.require_running()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LabConfigError(f"rank must be between 0 and {self.world_size - 1}, got {rank!r}")
        pid = cluster.pid_of.get(rank)
        cluster.signal([rank], signal.SIGKILL)
        return f"rank {rank} (pid {pid}) killed with SIGKILL"

    def execute(self, ranks: int | Iterable[int] | None, work_entry: Callable, args: tuple,
                timeout: float | None = None, live: bool | None = None, show_values: bool = False,
                view: str | None = None, on_interrupt: Callable[[], float] | None = None) -> dict[int, RankReport]:
        """User work on ``ranks`` (None: every rank) within ``timeout``: every rank's report (by rank), or
        one raised failure. The ranks are healed first and only then targeted: a heal may drop a lost rank that joined
        from another machine and renumber the others, so "every rank" means every rank after it."""
        limit = self.limit(timeout)  # refused before anything happens
        before = self.world_size
        asked = self.targets(ranks)
        self.ready()
        if self.world_size != before and asked == list(range(before)):
            ranks = None  # the caller listed every rank the lab had: it meant all of them
        ranks = self.targets(ranks)
        work = self.begin(ranks, work_entry, args, limit, make_output(ranks, live=live, show_values=show_values,
                                                                      view=view), on_interrupt=on_interrupt)
        self.foreground = work
        try:
            reports = work.wait()
        finally:
            if self.foreground is work:
                self.foreground = None
            work.forget_results()
        if work.failed:
            raise self.failure(work, reports, limit)
        return reports

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        reports = self.execute(None, entry.call, (fn, args, kwargs, notebook_sources(fn)), timeout)
        return [reports[rank]["value"] for rank in sorted(reports)]

    def call(self, ranks: Iterable[int], work_entry: Callable, args: tuple, timeout: float) -> list:
        """One of the lab's own entry points (not user work) on ``ranks``, within ``timeout``."""
        return self.require_idle().call(ranks, work_entry, args, timeout)

    # -- process group and mesh -------------------------------------------------

    def form_group(self, reason: str = "") -> dict[int, list[str]]:
        """A fresh store on rank 0, every rank forms the world anew (a start, or ranks replaced, dropped or
        joined), the mesh is rebuilt. What was built on the groups of before fails with ``reason``; returns,
        by rank, the variables that held it (``runs.recovery.unusable_note`` says them)."""
        self.generation += 1
        self.last_training = None  # the ranks' training state lived on the old groups
        limit = self.start_timeout
        cluster = self.require_running()
        # Every rank lets go of the old groups before any builds the new world (a rank closing its old
        # connections while its peers connect anew broke the new groups); a first world has none.
        held = {} if self.generation == 1 else dict(enumerate(self.call(range(self.world_size), entry.leave_groups,
                                                                        (reason,), limit)))
        store_host, store_port = self.call([0], entry.open_store, (limit,), limit)[0]
        places = {engine: {"rank": rank, "world_size": self.world_size, "store_host": store_host,
                           "store_port": store_port} for rank, engine in cluster.engine_of.items()}
        self.call(range(self.world_size), entry.join_group, (places, self.generation, limit, reason), limit)
        self.control.attach(*cluster.store_address(store_host, store_port))  # a site's: through its line
        if self.link is not None:  # replaced ranks get it too; the others put it on their new world group
            self.call(range(self.world_size), entry.set_link, (self.link,), limit)
        if self.mesh_spec is not None:
            self.build_mesh(self.mesh_spec)
        return {rank: names for rank, names in held.items() if names}

    def rebuild_group(self) -> None:
        """The same ranks rebuild every process group in place: what was built on the groups goes on."""
        self.generation += 1
        limit = self.start_timeout
        # Every rank closes its old connections before any connects anew (as in form_group).
        self.call(range(self.world_size), entry.release_collectives, (), limit)
        self.call(range(self.world_size), entry.rebuild_groups, (self.generation, limit), limit)

    def check_group(self) -> None:
        from labkit.runs.link import waiting_notice  # its all-reduce crosses the simulated link: say so if slow

        with waiting_notice(self.link, "check their new process group"):
            sums = self.call(range(self.world_size), entry.all_reduce_check, (), self.start_timeout)
        if any(value != self.world_size for value in sums):
            raise LabError(f"the first all-reduce gave {sums}, expected {self.world_size} on every rank")

    def build_mesh(self, spec: MeshSpec) -> None:
        ranks = range(self.world_size)
        coordinates = self.call(ranks, entry.build_mesh, (list(spec.shape), list(spec.names)), self.start_timeout)
        for rank, reported in zip(ranks, coordinates):
            if tuple(reported) != spec.coordinate(rank):
                raise LabError(f"rank {rank} reports mesh coordinate {tuple(reported)}, expected {spec.coordinate(rank)}")

    def set_mesh(self, spec: MeshSpec) -> None:
        """Make ``spec`` the lab's mesh on every rank, or leave the lab as it was."""
        self.ready()
        try:
            self.build_mesh(spec)
        except LabError:
            self.form_group()  # a working group with the previous mesh
            raise
        self.mesh_spec = spec

    def recover(self, work: RankWork, reports: dict[int, RankReport] | None = None) -> str:
        """After failed work: bring the lab back for the next call (``runs.recovery``); say what was done."""
        return recover(self, work, reports if reports is not None else work.reports)
