"""User work watched by the lab's instruments: a torchrun script or a ``%%lab`` cell, live.

``lab.run_script(path, *args)`` runs a script exactly as it would under torchrun
(the lab's guarantee: the same results to the last bit), and measures nothing.
With ``instruments=True`` (implied by ``dashboard`` and ``background``) every rank
watches the loop (``rank.instruments.loop_watch``): steps end at its optimizer
steps, collectives are timed on the rank's groups. A ``WatchedRun`` reads the rows
the ranks publish while the work runs into a ``MetricsTable``, draws them on a
``Dashboard`` when asked, and ends with a ``LoopReport``. The hooks read shapes and
clocks only, so the results stay bitwise those of the run without instruments.

``background=True`` returns at once; ``stop()`` asks every rank to stop at the
same step boundary (they agree every few steps, as under ``lab.train``): the loop
gets ``labkit.StopRequested`` there, which it may catch, and never mid-collective.
"""

from __future__ import annotations

import shlex
import threading
from typing import TYPE_CHECKING, cast

from labkit.runs.dispatch import RankWork, make_output
from labkit.runs.holder import StoppableRun
from labkit.runs.sources import read_script, script_argv
from labkit.spec.errors import LabError
from labkit.views.loop_report import LoopReport
from labkit.views.metrics import MetricsTable
from labkit.wire import entry
from labkit.wire.schema import LoopResult

if TYPE_CHECKING:
    from labkit.session import Session
    from labkit.views.dashboard import Dashboard


def run_script(session: Session, path, args: tuple, ranks=None, timeout: float | None = None,
               instruments: bool = False, dashboard: bool = False, background: bool = False):
    """Run the script at ``path`` with ``args`` on ``ranks`` (None: all).

    Returns None without instruments; with them its ``LoopReport``, or at once its ``WatchedRun`` in the
    background."""
    source, where = read_script(path)
    argv = script_argv(path, args)
    if not (instruments or dashboard or background):
        session.execute(ranks, entry.run_script, (source, where, argv, None), timeout)
        return None
    title = " ".join(shlex.quote(word) for word in argv)
    stoppable = background or dashboard
    return watch(session, title, entry.run_script, (source, where, argv, {"stoppable": stoppable}), ranks, timeout,
                 dashboard, background)


def run_cell(session: Session, code: str, cell: int | None, ranks=None, timeout: float | None = None,
             dashboard: bool = False, background: bool = False):
    """A ``%%lab`` cell's code with its loop watched: its ``LoopReport``, or its ``WatchedRun`` in the background."""
    title = f"%%lab cell In[{cell}]" if cell is not None else "lab.run_cell"
    watched = {"stoppable": dashboard or background}
    return watch(session, title, entry.run_cell, (code, cell, watched), ranks, timeout, dashboard, background)


def watch(session: Session, title: str, work_entry, args: tuple, ranks, timeout: float | None, dashboard: bool,
          background: bool):
    limit = session.limit(timeout)
    session.ready()
    run = WatchedRun(session, title, session.targets(ranks), limit, dashboard, background)
    session.claim(run)
    try:
        return run.start(work_entry, args)
    except BaseException:
        session.release(run)  # a run that never started must not leave the lab busy
        raise


class WatchedRun(StoppableRun):
    """User work on the ranks with instruments on: live rows, an optional dashboard, a clean stop."""

    def __init__(self, session: Session, title: str, ranks: list[int], timeout: float, dashboard: bool,
                 background: bool) -> None:
        self.session = session
        self.title = title
        self.ranks = ranks
        self.timeout = timeout
        self.background = background
        self.table = MetricsTable(len(ranks), None)
        self.dashboard: Dashboard | None = None
        if dashboard:
            from labkit.views import dashboard as live  # matplotlib and ipywidgets load with the first one

            self.dashboard = live.Dashboard(self.table, title, on_stop=self.stop if background else None,
                                            hint="" if background else "interrupt the kernel (■) to stop at a step "
                                                                          "boundary")
        self.report: LoopReport | None = None
        self.error: BaseException | None = None
        self._work: RankWork | None = None
        self._done = threading.Event()

    def start(self, work_entry, args: tuple):
        """Send the work; in the background return this run at once, else its report (or raise)."""
        if self.dashboard is not None:
            self.dashboard.show()
        self.session.control.request_stop(False)
        self._work = self.session.begin(
            self.ranks, work_entry, args, self.timeout,
            output=make_output(self.ranks, live=False if self.background else None, show_values=False,
                               silent=self.background),
            on_tick=self.tick, on_interrupt=self._wind_down)
        if self.background:
            threading.Thread(target=self._finish, name="labkit-watched-run", daemon=True).start()
            return self
        self._finish()
        return self.wait()

    def tick(self, work: RankWork) -> None:
        """Merge the rows the ranks published; redraw the dashboard."""
        for result in work.results.values():
            data = result.data if isinstance(result.data, dict) else {}
            self.table.merge(data.get("labkit_rows"))
        if self.dashboard is not None:
            self.dashboard.update()

    def _finish(self) -> None:
        work = self._work
        assert work is not None, "start sends the work before anything waits for it"
        try:
            reports = work.wait()
            self.session.release(self)
            if work.failed:
                self.error = self.session.failure(work, reports, self.timeout)
            else:
                # A script's runtime answers its value, a cell's its display: the watch's result either way.
                results = [cast(LoopResult, reports[rank].get("value", reports[rank].get("display")))
                           for rank in sorted(reports)]
                for result in results:
                    self.table.merge_rows(result["rows"])
                self.report = LoopReport(self.title, results, stopped=any(result["stopped"] for result in results))
        except BaseException as error:  # kept for wait(); a background thread has nobody else to tell
            self.error = error
        finally:
            try:
                self.session.control.request_stop(False)
            except LabError:
                pass
            self.session.release(self)
            if self.dashboard is not None:
                self.dashboard.finish(self.status())
            self._done.set()

    # -- what a holder of the ranks answers (stop, done, finished: StoppableRun's) ---

    def _going(self) -> str:
        return self.title

    def wait(self, timeout: float | None = None) -> LoopReport:
        """Block until the work ends; its report, or its failure raised."""
        return super().wait(timeout)

    def status(self) -> str:
        if self.error is not None:
            return f"failed: {str(self.error).splitlines()[0]}"
        if self.report is not None:
            return f"done: {self.report.steps_done} steps" + (" (stopped)" if self.report.stopped else "")
        step = self.table.latest_step
        return "starting" if step is None else f"running, step {step + 1}"

    def __repr__(self) -> str:
        return f"<WatchedRun {self.title}: {self.status()}>"
