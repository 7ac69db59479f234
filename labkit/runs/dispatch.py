"""Send one piece of work to some ranks and get every rank's report back, in bounded time.

The work is one ``wire.entry`` entry point applied on each rank. While it runs,
the ranks' output is shown live. When it ends, every rank has a report: the
runtime's own dict, or one made here for a rank that hung, died or was
interrupted. How a stuck rank is brought back, in order:

1. collectives time out on their own: each rank bounds them by the same limit;
2. past the limit (plus a moment for those timeouts to land), ranks still busy
   get SIGINT, which raises KeyboardInterrupt in Python code;
3. a rank that still does not answer within ``interrupt_grace`` seconds (stuck
   in C code) is killed and replaced by a fresh process.

A kernel interrupt (the notebook's stop button) starts at step 2 at once.

While ranks are busy, the notebook reads where each one is (its line, what its
groups have in flight and wait for: ``rank.whereabouts``) from the ranks' store
every ``READ_SECONDS`` in a thread (``cluster.rank_whereabouts``), keeps the
latest in ``whereabouts`` (``lab.status`` shows them) and names a deadlock from
them (``runs.deadlock``): a rank waits in a collective that a rank that finished,
failed or is not in the work will never join, or the ranks called different
collectives, or all of them wait and none can go on. Then the waiting ranks are
made to fail at once instead of at the limit: idle ranks close their groups'
connections (``entry.release_collectives``), blocked ranks are asked to close
their own (their whereabouts thread does), ``released`` tells the session that
the groups must be rebuilt in place, and ``deadlock`` says what happened. A rank
that merely failed while others compute releases nothing. Only when a busy rank's
whereabouts cannot be read does a failed rank release its peers after
``FALLBACK_RELEASE_SECONDS``.

User work runs in the notebook's folder, umask and environment of the moment it
is sent (``runs.notebook_process``): they travel with it to each rank.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from labkit.cluster.rank_logs import keep_rank_log
from labkit.cluster.rank_whereabouts import WhereaboutsReader
from labkit.runs.deadlock import DeadlockWatch, in_flight, transfers_waited
from labkit.runs.own_interrupts import told_as_raised
from labkit.runs.debugging import BreakpointDesk
from labkit.spec.errors import LabError
from labkit.views.rank_output import LiveOutput, RankTexts
from labkit.wire import entry as rank_entry
from labkit.wire.schema import FailureKind, RankReport

if TYPE_CHECKING:
    from labkit.cluster.rank_cluster import RankCluster
    from labkit.runs.notebook_process import NotebookProcess

POLL_SECONDS = 0.1  # waits end early when a result lands; this paces output and liveness checks
LIVENESS_CHECK_SECONDS = 0.5
OUTPUT_GRACE_SECONDS = 2.0
RELEASE_CALL_SECONDS = 10.0
ABSENT_CALL_SECONDS = 2.0  # an idle rank answers at once; one busy with other work is left unknown
READ_AFTER_SECONDS = 0.2  # work that ends sooner is never watched (nor is torch loaded here for it)
STALE_SECONDS = 3.0  # a rank publishes at least every second: an older value is not trusted
# When a busy rank's whereabouts cannot be read, how long after a failure its peers are released anyway.
FALLBACK_RELEASE_SECONDS = 4.0


def _report(rank: int, kind: str, error_type: str, message: str, traceback: str = "") -> RankReport:
    return {
        "rank": rank,
        "ok": False,
        "error": {"type": error_type, "message": message, "traceback": traceback, "kind": kind},
    }


def _report_from_remote_error(rank: int, error: BaseException) -> RankReport:
    """A failure outside the runtime's guard (e.g. an interrupt during clean-up)."""
    error_type = getattr(error, "ename", type(error).__name__)
    message = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    if isinstance(traceback, (list, tuple)):
        traceback = "\n".join(traceback)
    kind = FailureKind.INTERRUPTED if error_type == "KeyboardInterrupt" else FailureKind.RAISED
    frames = str(traceback)
    if "deserialize_object" in frames or "unpack_apply_message" in frames:
        # The work never ran: what it was given could not be read on the rank.
        # ipyparallel's frames say nothing to the user: the whole explanation stands where they would.
        explained = _unreadable_work(error_type, message)
        return _report(rank, kind, error_type, explained, f"{error_type}: {explained}")
    if "serialize_object" in frames:
        # The work ran; its result could not be pickled back. ipyparallel's frames say nothing more.
        return _report(rank, kind, error_type,
                       f"the work ran, but its result could not be sent back: {message}. Results travel pickled: "
                       "return plain data (numbers, strings, lists, dicts, tensors), and keep locks, open files, "
                       "sockets or modules in the rank's namespace instead")
    return _report(rank, kind, error_type, message, str(traceback))


def _unreadable_work(error_type: str, message: str) -> str:
    """Why work sent to a rank could not be read there, and what to do."""
    text = f"the work could not be read on this rank, so it did not run: {message}"
    if error_type in ("ModuleNotFoundError", "ImportError", "AttributeError"):
        text += ("\nA function or class of a module the notebook imported travels by name, and the rank must import "
                 "the same module: install it where the ranks run, put its folder on their path (a %%lab cell: "
                 "import sys; sys.path.insert(0, FOLDER)), or define it in a notebook cell")
    return text


class RankWork:
    """One entry point running on some ranks; ``wait()`` returns ``{rank: report}``."""

    def __init__(
        self,
        cluster: RankCluster,
        ranks: Iterable[int],
        entry: Callable,
        args: tuple,
        timeout: float,
        interrupt_grace: float,
        output: LiveOutput,
        on_tick: Callable[[RankWork], None] | None = None,
        on_interrupt: Callable[[], float] | None = None,
        notebook: NotebookProcess | None = None,
        store_address: tuple[str, int] | None = None,
    ) -> None:
        """``on_tick(work)`` runs at every poll (live metrics read ``work.results``);
        ``on_interrupt()`` may ask the ranks to wind down and return how many
        seconds to give them before they are interrupted. ``notebook``: the
        ``NotebookProcess`` whose state the work runs in (None: the ranks' own). ``store_address``:
        the ranks' rendezvous store, where they publish their whereabouts (None: not watched)."""
        self.cluster = cluster
        self.on_tick = on_tick
        self.on_interrupt = on_interrupt
        self.ranks = list(ranks)
        self.timeout = timeout
        self.interrupt_grace = interrupt_grace
        self.output = output
        self.reports: dict[int, RankReport] = {}
        self.replaced: list[int] = []
        self.timed_out = False
        self.interrupted = False
        self.released = False  # ranks closed their groups' connections: the groups must be rebuilt
        self.whereabouts: dict[int, dict] = {}  # busy rank -> where it is (rank.whereabouts), fresh values only
        self.deadlock: str | None = None  # the deadlock that made the work fail, in words
        self.store_address = store_address
        self._reader: WhereaboutsReader | None = None
        self._watch = DeadlockWatch()
        self._absent_groups: dict[int, dict | None] = {}  # ranks not in the work -> their groups (None: unknown)
        self._deadlock_groups: set[str] | None = None  # once a deadlock is found: the groups it is on
        self._released_from: set[int] = set()  # idle ranks that closed their connections
        self._release_asked: set[int] = set()  # busy ranks asked to close theirs
        self._first_failure: float | None = None
        self.breakpoints = BreakpointDesk(self, self._check_alive)  # the prompt of ranks stopped at breakpoint()
        if notebook is None:
            self.pending = {rank: cluster.engine(rank).apply_async(entry, *args) for rank in self.ranks}
        else:
            state = notebook.state()
            self.pending = {rank: cluster.engine(rank).apply_async(
                rank_entry.in_notebook_state, notebook.state_for(state, cluster.records.get(rank)), entry, *args)
                for rank in self.ranks}
        self.results = dict(self.pending)  # every rank's AsyncResult, finished or not
        # What each rank's published whereabouts name (the request's ipyparallel message id).
        self.work_ids = {rank: (getattr(result, "msg_ids", None) or [None])[0] for rank, result in self.pending.items()}
        self.started = time.monotonic()

    # -- watching -------------------------------------------------------------

    def _collect(self) -> None:
        """Move finished ranks from ``pending`` to ``reports``; refresh output."""
        for rank, result in list(self.pending.items()):
            done = result.ready()
            if done:
                # The result can overtake the rank's last output on the wire.
                result.wait_for_output(OUTPUT_GRACE_SECONDS)
            self.output.update(rank, result.stdout or "", result.stderr or "", getattr(result, "outputs", None))
            if not done:
                continue
            del self.pending[rank]
            try:
                report = result.get(0)
            except Exception as error:  # the runtime's guard itself was cut short, or its engine went
                report = self._lost_report(rank) if getattr(error, "ename", type(error).__name__) == "EngineError" else \
                    _report_from_remote_error(rank, error)
            self.reports[rank] = report
            if report.get("ok") and report.get("display") is not None:
                self.output.texts.set_result(rank, report["display"], report.get("rich"))
        self.output.tick()
        if self.on_tick is not None:
            self.on_tick(self)

    def _check_alive(self) -> None:
        for rank in list(self.pending):
            reason = self.cluster.condition(rank)
            if reason is not None:
                if not reason.startswith("exited"):
                    # Frozen or cut off, its sockets stay open and its peers would wait in a
                    # collective until the limit: ended now, it releases them at once.
                    self.cluster.signal([rank], signal.SIGKILL)
                del self.pending[rank]
                self.reports[rank] = self._lost_report(rank, reason)

    # -- deadlocks ----------------------------------------------------------------

    def _watch_collectives(self) -> None:
        """Read where the busy ranks are; when a deadlock shows, make the waiting ranks fail now."""
        if not self.pending:
            return
        now = time.monotonic()
        if self._reader is None and self.store_address is not None and now - self.started >= READ_AFTER_SECONDS:
            self._reader = WhereaboutsReader(self.store_address, self.work_ids)
        states = {}
        if self._reader is not None:
            self._reader.watch_only(self.pending)
            states = {rank: state for rank, state in self._reader.states.items()
                      if rank in self.pending and now - state["seen_at"] < STALE_SECONDS}
        self.whereabouts = states
        self.output.note(self.breakpoints.note(states, now))
        if self._deadlock_groups is not None:
            self._release(states)  # ranks that stop or wait since are released too
            return
        if any(report.get("error", {}).get("kind") in (FailureKind.DIED, FailureKind.COLLECTIVE)
               for report in self.reports.values()):
            # A rank died, or a collective failed under one: its groups are cut, and whoever waits in
            # one of them waits for nothing. Everyone in a collective is released, now and from now on.
            self._deadlock_groups = set()
            self.released = True
            self._release(states)
            return
        found = None
        if states and self._reader is not None:  # (only a reader finds states)
            found = self._watch.check(states, self.reports, self._absent(states), self.ranks, list(self.pending),
                                      now, self._reader.rounds)
        if found is None:
            self._fallback_release(now, states)
            return
        # Told first only when it is the news: not past the limit, nor when a rank failed on its own (its
        # error is the cause, and the failure already says the others waited for it).
        own = any(not report.get("ok") and report.get("error", {}).get("kind") != FailureKind.COLLECTIVE
                  for report in self.reports.values())
        if not (self.timed_out or self.interrupted or own):
            self.deadlock = found.text
        self._deadlock_groups = found.groups
        self.released = True
        self._release(states)

    def _absent(self, states: dict) -> dict:
        """The groups of the ranks outside the work that share a group with a busy rank's collective."""
        outside = {member for rank, state in states.items() for item in in_flight(rank, state.get("groups"))
                   for member in item.members} - set(self.ranks) - set(self._absent_groups)
        if outside:
            from labkit.rank.whereabouts import group_state  # sent by reference: the ranks have it

            asked = sorted(outside)
            try:
                answers = self.cluster.call(asked, group_state, (), ABSENT_CALL_SECONDS)
            except LabError:  # busy with other work, or gone: not known, and so never blamed
                answers = [None] * len(asked)
            self._absent_groups.update(zip(asked, answers))
        return {rank: groups for rank, groups in self._absent_groups.items() if groups is not None}

    def _release(self, states: dict) -> None:
        """Idle ranks on the deadlocked groups close their connections; busy ranks with collectives in flight
        are asked to close theirs (each once)."""
        groups = self._deadlock_groups or set()
        idle = [rank for rank, report in self.reports.items()
                if report.get("error", {}).get("kind") != FailureKind.DIED]
        idle += [rank for rank, state in self._absent_groups.items() if state and groups & set(state)]
        idle = sorted(set(idle) - self._released_from)
        if idle:
            self._released_from.update(idle)
            try:
                self.cluster.call(idle, rank_entry.release_collectives, (), RELEASE_CALL_SECONDS)
            except LabError:  # it went meanwhile: its connections closed with it
                pass
        blocked = sorted(rank for rank, state in states.items() if rank not in self._release_asked and (
            in_flight(rank, state.get("groups")) or transfers_waited(rank, state.get("groups"))))
        if blocked and self._reader is not None:
            self._release_asked.update(blocked)
            self._reader.request_release(blocked)

    def _fallback_release(self, now: float, states: dict) -> None:
        """A rank failed while busy peers' whereabouts cannot be read: release them after a while anyway."""
        failed = [rank for rank, report in self.reports.items()
                  if not report.get("ok") and rank not in self._released_from]
        if not failed:
            return
        if self._first_failure is None:
            self._first_failure = now
        unknown = [rank for rank in self.pending if rank not in states]
        if not unknown or now - self._first_failure < FALLBACK_RELEASE_SECONDS:
            return
        self._released_from.update(failed)
        alive = [rank for rank in failed if self.reports[rank]["error"]["kind"] != FailureKind.DIED]
        if alive:
            try:
                self.cluster.call(alive, rank_entry.release_collectives, (), RELEASE_CALL_SECONDS)
            except LabError:
                pass
        self.released = True

    def _lost_report(self, rank: int, reason: str | None = None) -> RankReport:
        """The report of a rank whose process ended or that the controller lost (the hub says which)."""
        reason = reason or self.cluster.condition(rank) or "ended while it ran the work"
        error_type = "ProcessDied" if reason.startswith("exited") else "ProcessLost"
        if error_type == "ProcessDied" and (log := keep_rank_log(self.cluster, rank)):  # before a new one writes
            reason += f"\nits log: {log}"
        return _report(rank, FailureKind.DIED, error_type, f"the rank's process {reason}")

    def _wait_until(self, deadline: float) -> None:
        next_liveness = time.monotonic() + LIVENESS_CHECK_SECONDS
        while self.pending and time.monotonic() < deadline:
            self._collect()
            if time.monotonic() >= next_liveness:
                self._check_alive()
                next_liveness = time.monotonic() + LIVENESS_CHECK_SECONDS
            self._watch_collectives()
            deadline += self.breakpoints.serve()  # the time at a breakpoint's prompt is not the work's
            if self.pending:
                # Wakes as soon as a result lands, else redraws output every POLL_SECONDS.
                first = next(iter(self.pending.values()))
                first.wait(max(0.0, min(POLL_SECONDS, deadline - time.monotonic())))
        self._collect()

    # -- bringing stuck ranks back ---------------------------------------------

    def settle_seconds(self) -> float:
        """Time past the limit for the ranks' own collective timeouts to fire."""
        return min(3.0, 0.5 + 0.1 * self.timeout)

    def _escalate(self) -> None:
        if not self.pending:
            return
        self.cluster.signal(list(self.pending), signal.SIGINT)
        self._wait_until(time.monotonic() + self.interrupt_grace)
        if not self.pending:
            return
        stuck = sorted(self.pending)
        for rank in stuck:
            self.reports[rank] = _report(rank, FailureKind.INTERRUPTED, "Unresponsive", "did not respond to an "
                                         f"interrupt within {self.interrupt_grace:g} s; its process was replaced")
        self.pending.clear()
        self.cluster.replace(stuck)
        self.replaced = stuck

    def wait(self) -> dict[int, RankReport]:
        try:
            self._wait_until(self.started + self.timeout)
            if self.pending:
                self._wait_until(time.monotonic() + self.settle_seconds())
                if self.pending:
                    self.timed_out = True
                    self._escalate()
        except KeyboardInterrupt:
            self.interrupted = True  # whatever ends the work now, the kernel's interrupt did
            grace = self.on_interrupt() if self.on_interrupt is not None else 0.0
            if grace:
                try:
                    self._wait_until(time.monotonic() + grace)  # let them stop on their own first
                except KeyboardInterrupt:
                    pass
            if self.pending:
                self._escalate_after_interrupt()
        finally:
            if self._reader is not None:
                self._reader.stop()
            self.whereabouts = {}
            self.output.finish()
        told_as_raised(self.reports, signalled=self.timed_out or self.interrupted)  # else none were: the work's own
        return dict(sorted(self.reports.items()))

    def _escalate_after_interrupt(self) -> None:
        # A second Ctrl-C while we bring the ranks back must not leave them stuck.
        previous = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: nothing to protect
            previous = None
        try:
            self._escalate()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def forget_results(self) -> None:
        """Drop what ipyparallel's client keeps of this work once it is read (output, displays, result):
        a session of many cells that plot would otherwise hold every picture until the lab stops."""
        client = getattr(self.cluster, "client", None)
        if client is not None:
            done = [msg_id for msg_id in self.work_ids.values() if msg_id and msg_id not in client.outstanding]
            if done:
                client.purge_local_results(jobs=done)

    @property
    def failed(self) -> bool:
        return bool(self.replaced) or any(not report.get("ok") for report in self.reports.values())


def make_output(ranks, live: bool | None = None, show_values: bool = True, silent: bool = False,
                view: str | None = None) -> LiveOutput:
    return LiveOutput(RankTexts(ranks), live=live, show_values=show_values, silent=silent, view=view)
