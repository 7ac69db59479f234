"""``Session``: the one owner of a lab's ranks.

It holds the processes (a ``RankCluster``), the process group's generation, the
mesh, the control channel and the busy lock, and it is the only code that
changes them. Everything the notebook does with ranks goes through it:

- ``execute`` sends user work and returns every rank's report, or recovers the
  lab and raises one failure (``failure`` is the single place that turns failed
  work into ``RankFailure`` / ``RankTimeout`` / ``RankInterrupted``);
- ``call`` runs the lab's own entry points (rendezvous, mesh) within a limit;
- ``begin`` / ``failure`` let a long run (``runs.training_run``) watch its work
  while it goes, after ``claim`` made the ranks its own.

``Lab`` is a thin facade over a session; the features in ``labkit.runs`` take a
session. Nothing here imports torch: the ranks' code is reached through
``labkit.rank.entry``.
"""

from __future__ import annotations

import atexit
import pickle
import signal
import threading
import time
import weakref
from dataclasses import dataclass

from labkit.cluster.control import ControlRequests
from labkit.cluster.placement import RankPlan
from labkit.cluster.rank_cluster import RankCluster
from labkit.rank import entry
from labkit.runs.dispatch import RankWork, make_output
from labkit.runs.sources import notebook_sources
from labkit.spec.errors import (
    LabBusy,
    LabConfigError,
    LabError,
    LabNotRunning,
    RankFailure,
    RankInterrupted,
    RankTimeout,
    format_ranks,
)
from labkit.spec.mesh import MeshSpec
from labkit.spec.train_config import TrainConfig
from labkit.units import positive_seconds


@dataclass(frozen=True)
class TrainingRecord:
    """The notebook's note of the training state the ranks keep: which run, how far, on which group."""

    config: TrainConfig
    steps_done: int  # in all, over the run and its continuations
    generation: int


def _stop_at_exit(session_ref) -> None:
    session = session_ref()
    if session is not None:
        session.stop()


class Session:
    """The ranks of one lab and everything that must change together with them."""

    def __init__(self, plan: RankPlan, timeout: float, start_timeout: float, interrupt_grace: float) -> None:
        self.plan = plan
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.interrupt_grace = interrupt_grace
        self.cluster: RankCluster | None = None
        self.generation = 0
        self.mesh_spec: MeshSpec | None = None
        self.started_seconds: float | None = None
        self.control = ControlRequests()
        # The simulated slow link (a spec.link.LinkSpec, lab.link), kept like the mesh: every group formed gets it.
        self.link = None
        self.last_training: TrainingRecord | None = None  # what the ranks' TrainState holds
        self.interrupted = None  # the last run, when it failed before its end
        self._holder = None  # a long run that owns the ranks (a TrainingRun)
        self._holder_lock = threading.Lock()
        self._atexit = None

    @property
    def world_size(self) -> int:
        return self.plan.ranks

    @property
    def running(self) -> bool:
        return self.cluster is not None

    # -- start / stop ---------------------------------------------------------

    def start(self) -> None:
        if self.running:
            if self.cluster.infrastructure_problem() is None and self.busy_with is None:
                self.heal()  # a running lab is reused, its broken ranks replaced
                return
            self.stop()
        began = time.monotonic()
        cluster = RankCluster(self.plan, start_timeout=self.start_timeout)
        cluster.start()
        self.cluster = cluster
        self.control = ControlRequests(cluster.control_path)
        self._atexit = lambda ref=weakref.ref(self): _stop_at_exit(ref)
        atexit.register(self._atexit)
        try:
            self.form_group()
            self.check_group()
        except BaseException:
            self.stop()
            raise
        self.started_seconds = time.monotonic() - began

    def stop(self) -> None:
        holder = self._holder
        if holder is not None and not holder.done:
            holder.stop()  # let a background run end at a step boundary before the ranks go
            holder.finished(10)
        self._holder = None  # whatever held the ranks, they are gone
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

    def remember_interrupted(self, interrupted) -> None:
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
            raise LabBusy(
                f"a training run is in progress ({holder.status()}): "
                "wait for it (run.wait()) or stop it (run.stop(), or its Stop button) first"
            )
        return cluster

    def claim(self, holder) -> None:
        """Make the ranks ``holder``'s until ``release``: other work is refused with ``LabBusy``."""
        with self._holder_lock:
            self.require_idle()
            self._holder = holder

    def release(self, holder) -> None:
        with self._holder_lock:
            if self._holder is holder:
                self._holder = None

    @property
    def busy_with(self) -> str | None:
        """What holds the ranks now, in words (None when they are free)."""
        holder = self._holder
        return holder.status() if holder is not None and not holder.done else None

    # -- work -------------------------------------------------------------------

    def limit(self, timeout) -> float:
        return self.timeout if timeout is None else positive_seconds("timeout", timeout)

    def targets(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        targets = sorted(set(int(rank) for rank in ranks))
        wrong = [rank for rank in targets if not 0 <= rank < self.world_size]
        if wrong or not targets:
            raise ValueError(f"ranks must be between 0 and {self.world_size - 1}, got {list(ranks)}")
        return targets

    def begin(self, ranks, work_entry, args, limit: float, output, on_tick=None, on_interrupt=None) -> RankWork:
        """Start ``work_entry(*args, limit)`` on ``ranks``; the caller waits and checks ``failure``."""
        cluster = self.require_running()
        try:
            return RankWork(cluster, ranks, work_entry, (*args, limit), timeout=limit,
                            interrupt_grace=self.interrupt_grace, output=output, on_tick=on_tick,
                            on_interrupt=on_interrupt)
        except (TypeError, AttributeError, pickle.PicklingError) as error:
            # Sending pickles the function and its arguments; nothing reached a rank that could run.
            raise LabConfigError(
                f"the work could not be sent to the ranks: {error}. A function and its arguments travel to each "
                "rank pickled: pass plain data (numbers, strings, lists, dicts, tensors), and make locks, open "
                "files, sockets or clients on the ranks instead"
            ) from None

    def failure(self, work: RankWork, reports: dict, limit: float) -> LabError:
        """Failed work as the exception to raise, after bringing the lab back for the next call."""
        try:
            recovery = self.recover(work)
        except LabError as error:
            recovery = f"The process group could not be rebuilt ({error}); call lab.restart() (or %lab restart)."
        kind = RankInterrupted if work.interrupted else RankTimeout if work.timed_out else RankFailure
        return kind(reports, timed_out=work.timed_out, timeout_seconds=limit, interrupted=work.interrupted,
                    replaced=tuple(work.replaced), recovery=recovery)

    def ready(self) -> RankCluster:
        """Idle ranks that can all work: a rank that died, froze or was dropped since the last
        call is replaced first (``heal``)."""
        cluster = self.require_idle()
        self.heal()
        return cluster

    def heal(self) -> str | None:
        """Replace every rank that cannot work (a frozen one is killed first), rebuild the group; say so.

        The other ranks keep their namespaces. Returns the note it printed, None when all was well."""
        cluster = self.require_running()
        problem = cluster.infrastructure_problem()
        if problem:
            raise LabError(f"{problem}: the lab cannot go on; call lab.restart() (or %lab restart) for fresh ranks")
        broken = cluster.broken_ranks()
        if not broken:
            return None
        try:
            cluster.replace(broken)
            self.form_group()
        except Exception as error:  # noqa: BLE001 - whatever stops the repair, the way out is a restart
            raise LabError(f"{format_ranks(broken)} could not be replaced ({error}); "
                           "call lab.restart() (or %lab restart)") from None
        reasons = "; ".join(f"rank {rank} {reason}" for rank, reason in sorted(broken.items()))
        note = (f"labkit: {reasons}. Replaced with a fresh process and rebuilt the process group (generation "
                f"{self.generation}); the other ranks kept their variables.")
        print(note, flush=True)
        return note

    def kill(self, rank) -> str:
        """SIGKILL ``rank``'s process, busy or not; say which."""
        cluster = self.require_running()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LabConfigError(f"rank must be between 0 and {self.world_size - 1}, got {rank!r}")
        pid = cluster.pid_of.get(rank)
        cluster.signal([rank], signal.SIGKILL)
        return f"rank {rank} (pid {pid}) killed with SIGKILL"

    def execute(self, ranks, work_entry, args, timeout=None, live=None, show_values=False) -> dict[int, dict]:
        """User work on ``ranks`` within ``timeout``: every rank's report, or one raised failure."""
        self.ready()
        limit = self.limit(timeout)
        work = self.begin(ranks, work_entry, args, limit, make_output(ranks, live=live, show_values=show_values))
        reports = work.wait()
        if work.failed:
            raise self.failure(work, reports, limit)
        return reports

    def run(self, fn, *args, timeout=None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        ranks = self.targets(None)
        reports = self.execute(ranks, entry.call, (fn, args, kwargs, notebook_sources(fn)), timeout)
        return [reports[rank]["value"] for rank in ranks]

    def call(self, ranks, work_entry, args, timeout: float) -> list:
        """One of the lab's own entry points (not user work) on ``ranks``, within ``timeout``."""
        return self.require_idle().call(ranks, work_entry, args, timeout)

    # -- process group and mesh -------------------------------------------------

    def form_group(self) -> None:
        """A fresh rendezvous store on rank 0, every rank joins, the mesh is rebuilt."""
        self.generation += 1
        self.last_training = None  # the ranks' training state lived on the old group
        limit = self.start_timeout
        port = self.call([0], entry.open_store, (limit,), limit)[0]
        self.call(range(self.world_size), entry.join_group, (port, self.generation, limit), limit)
        if self.link is not None:  # replaced ranks get it too; the others put it on their new world group
            self.call(range(self.world_size), entry.set_link, (self.link,), limit)
        if self.mesh_spec is not None:
            self.build_mesh(self.mesh_spec)

    def check_group(self) -> None:
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

    def recover(self, work: RankWork) -> str:
        """After failed work: rebuild the process group so the next call works; say what was done."""
        cluster = self.require_running()
        dead = [rank for rank in range(self.world_size) if not cluster.is_alive(rank)]
        if dead:
            cluster.replace(dead)
        try:
            self.form_group()
        except LabError:
            # Some rank cannot even rejoin: start it afresh and try once more.
            cluster.replace(range(self.world_size))
            self.form_group()
        replaced = sorted(set(dead) | set(work.replaced))
        note = f"The process group was rebuilt (generation {self.generation})"
        if self.mesh_spec is not None:
            note += f" with mesh {self.mesh_spec.describe()}"
        if replaced:
            note += f"; {format_ranks(replaced)} restarted with empty namespaces"
        return note + "; the lab is ready for the next cell."
