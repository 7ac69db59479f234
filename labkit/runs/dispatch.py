"""Send one piece of work to some ranks and get every rank's report back, in bounded time.

The work is one ``rank.entry`` entry point applied on each rank. While it runs,
the ranks' output is shown live. When it ends, every rank has a report: the
runtime's own dict, or one made here for a rank that hung, died or was
interrupted. How a stuck rank is brought back, in order:

1. collectives time out on their own: each rank bounds them by the same limit;
2. past the limit (plus a moment for those timeouts to land), ranks still busy
   get SIGINT, which raises KeyboardInterrupt in Python code;
3. a rank that still does not answer within ``interrupt_grace`` seconds (stuck
   in C code) is killed and replaced by a fresh process.

A kernel interrupt (the notebook's stop button) starts at step 2 at once.

User work runs in the notebook's folder, umask and environment of the moment it
is sent (``runs.notebook_process``): they travel with it to each rank.
"""

from __future__ import annotations

import signal
import time

from labkit.rank import entry as rank_entry
from labkit.spec.schema import FailureKind, RankReport
from labkit.views.rank_output import LiveOutput, RankTexts

POLL_SECONDS = 0.1  # waits end early when a result lands; this paces output and liveness checks
LIVENESS_CHECK_SECONDS = 0.5
OUTPUT_GRACE_SECONDS = 2.0


def _report(rank: int, kind: str, error_type: str, message: str, traceback: str = "") -> RankReport:
    return {
        "rank": rank,
        "ok": False,
        "error": {"type": error_type, "message": message, "traceback": traceback, "kind": kind},
    }


def _report_from_remote_error(rank: int, error: BaseException) -> dict:
    """A failure outside the runtime's guard (e.g. an interrupt during clean-up)."""
    error_type = getattr(error, "ename", type(error).__name__)
    message = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    if isinstance(traceback, (list, tuple)):
        traceback = "\n".join(traceback)
    kind = FailureKind.INTERRUPTED if error_type == "KeyboardInterrupt" else FailureKind.RAISED
    if "serialize_object" in str(traceback):
        # The work ran; its result could not be pickled back. ipyparallel's frames say nothing more.
        return _report(rank, kind, error_type,
                       f"the work ran, but its result could not be sent back: {message}. Results travel pickled: "
                       "return plain data (numbers, strings, lists, dicts, tensors), and keep locks, open files, "
                       "sockets or modules in the rank's namespace instead")
    return _report(rank, kind, error_type, message, str(traceback))


class RankWork:
    """One entry point running on some ranks; ``wait()`` returns ``{rank: report}``."""

    def __init__(
        self,
        cluster,
        ranks,
        entry,
        args,
        timeout: float,
        interrupt_grace: float,
        output: LiveOutput,
        on_tick=None,
        on_interrupt=None,
        notebook=None,
    ):
        """``on_tick(work)`` runs at every poll (live metrics read ``work.results``);
        ``on_interrupt()`` may ask the ranks to wind down and return how many
        seconds to give them before they are interrupted. ``notebook``: the
        ``NotebookProcess`` whose state the work runs in (None: the ranks' own)."""
        self.cluster = cluster
        self.on_tick = on_tick
        self.on_interrupt = on_interrupt
        self.ranks = list(ranks)
        self.timeout = timeout
        self.interrupt_grace = interrupt_grace
        self.output = output
        self.reports: dict[int, dict] = {}
        self.replaced: list[int] = []
        self.timed_out = False
        self.interrupted = False
        if notebook is None:
            self.pending = {rank: cluster.engine(rank).apply_async(entry, *args) for rank in self.ranks}
        else:
            state = notebook.state()
            self.pending = {rank: cluster.engine(rank).apply_async(
                rank_entry.in_notebook_state, notebook.state_for(state, cluster.records.get(rank)), entry, *args)
                for rank in self.ranks}
        self.results = dict(self.pending)  # every rank's AsyncResult, finished or not
        self.started = time.monotonic()

    # -- watching -------------------------------------------------------------

    def _collect(self) -> None:
        """Move finished ranks from ``pending`` to ``reports``; refresh output."""
        for rank, result in list(self.pending.items()):
            done = result.ready()
            if done:
                # The result can overtake the rank's last output on the wire.
                result.wait_for_output(OUTPUT_GRACE_SECONDS)
            self.output.update(rank, result.stdout or "", result.stderr or "")
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
                self.output.texts.set_result(rank, report["display"])
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

    def _lost_report(self, rank: int, reason: str | None = None) -> RankReport:
        """The report of a rank whose process ended or that the controller lost (the hub says which)."""
        reason = reason or self.cluster.condition(rank) or "ended while it ran the work"
        error_type = "ProcessDied" if reason.startswith("exited") else "ProcessLost"
        return _report(rank, FailureKind.DIED, error_type, f"the rank's process {reason}")

    def _wait_until(self, deadline: float) -> None:
        next_liveness = time.monotonic() + LIVENESS_CHECK_SECONDS
        while self.pending and time.monotonic() < deadline:
            self._collect()
            if time.monotonic() >= next_liveness:
                self._check_alive()
                next_liveness = time.monotonic() + LIVENESS_CHECK_SECONDS
            if self.pending:
                # Wakes as soon as a result lands, else redraws output every POLL_SECONDS.
                first = next(iter(self.pending.values()))
                first.wait(max(0.0, min(POLL_SECONDS, deadline - time.monotonic())))
        self._collect()

    # -- bringing stuck ranks back ---------------------------------------------

    def _settle_seconds(self) -> float:
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
            self.reports[rank] = _report(
                rank,
                FailureKind.INTERRUPTED,
                "Unresponsive",
                f"did not respond to an interrupt within {self.interrupt_grace:g} s; its process was replaced",
            )
        self.pending.clear()
        self.cluster.replace(stuck)
        self.replaced = stuck

    def wait(self) -> dict[int, dict]:
        try:
            self._wait_until(self.started + self.timeout)
            if self.pending:
                self._wait_until(time.monotonic() + self._settle_seconds())
                if self.pending:
                    self.timed_out = True
                    self._escalate()
        except KeyboardInterrupt:
            grace = self.on_interrupt() if self.on_interrupt is not None else 0.0
            if grace:
                try:
                    self._wait_until(time.monotonic() + grace)  # let them stop on their own first
                except KeyboardInterrupt:
                    pass
            if self.pending:
                self.interrupted = True
                self._escalate_after_interrupt()
        finally:
            self.output.finish()
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

    @property
    def failed(self) -> bool:
        return bool(self.replaced) or any(not report.get("ok") for report in self.reports.values())


def make_output(ranks, live: bool | None = None, show_values: bool = True, silent: bool = False) -> LiveOutput:
    return LiveOutput(RankTexts(ranks), live=live, show_values=show_values, silent=silent)
