"""A training run in flight: live metrics, an optional dashboard, a clean stop.

``Lab.train`` makes one. It sends ``wire.entry.train`` to every rank and, while the
ranks work, reads the windows of step rows they publish (``ipyparallel``'s
``AsyncResult.data``) into a ``MetricsTable`` that the ``Dashboard`` draws. In
the background (``background=True``) the waiting happens on a thread of its
own: the notebook stays free, the Stop button works, and ``wait()`` hands over
the ``TrainReport``. Stopping never interrupts a collective: it asks the ranks,
through the lab's control file, to finish the step they are in; they agree on
the step to stop after and return what they did. Interrupting the kernel while
a run blocks does the same first, and only then interrupts.

A foreground run under a dashboard blocks its cell, and the kernel handles a
widget click only after the cell ends. Where jupyter-ui-poll can hand widget
messages over while a cell blocks, the wait does so between two looks at the
ranks, and the Stop button works there too; elsewhere the status line says to
interrupt the kernel instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

from labkit.runs.dispatch import RankWork, make_output
from labkit.runs.healing import Interrupted, continuation, has_checkpoint, surviving_step
from labkit.runs.holder import StoppableRun
from labkit.spec.errors import LabError
from labkit.spec.train_config import TrainConfig
from labkit.strategies.catalog import role_of
from labkit.views.metrics import DEFAULT_THRESHOLD, MetricsTable
from labkit.views.nonfinite_report import NonFiniteLoss
from labkit.views.rank_output import LiveOutput, in_kernel
from labkit.views.train_report import TrainReport
from labkit.wire import entry
from labkit.wire.schema import RankResult

if TYPE_CHECKING:
    from labkit.session import Session  # a layer above the runs it drives
    from labkit.views.dashboard import Dashboard  # loads matplotlib and ipywidgets: only when a run has one

UI_EVENTS_PER_TICK = 10  # widget messages handled between two looks at the ranks (a click is one)
STOP_HINT = "interrupt the kernel (■) to stop at a step boundary"
# jupyter-ui-poll's ui_events: a context in which poll(n) handles up to n waiting widget messages.
UiEvents = Callable[[], AbstractContextManager[Callable[[int], object]]]


class TrainingRun(StoppableRun):
    def __init__(self, session: Session, config: TrainConfig, timeout: float, dashboard: bool, background: bool,
                 straggler_threshold: float = DEFAULT_THRESHOLD) -> None:
        self.session = session
        self.config = config
        self.timeout = timeout
        self.background = background
        mesh = config.mesh
        stage = mesh.names.index("pp") if "pp" in mesh.names else None
        # Ranks doing the same work are compared for stragglers: one pipeline stage, one role (a parameter
        # server's servers do other work than its workers, so neither is measured against the other).
        peers = {rank: (mesh.coordinate(rank)[stage] if stage is not None else 0,
                        role_of(config.parts, config, rank)) for rank in range(session.world_size)}
        self.straggler_threshold = straggler_threshold
        self.target_step = config.first_step + config.steps
        self.table = MetricsTable(session.world_size, config.global_batch, peers, threshold=straggler_threshold)
        self.dashboard: Dashboard | None = None
        # A foreground run blocks its cell: its Stop button works only if widget messages are handled meanwhile.
        self._ui_events = notebook_ui_events() if dashboard and not background else None
        # While a foreground wait handles widget messages: the function that does it.
        self._ui_poll: Callable[[int], object] | None = None
        if dashboard:
            from labkit.views import dashboard as live  # matplotlib and ipywidgets load with the first one

            stoppable = background or self._ui_events is not None
            self.dashboard = live.Dashboard(self.table, config.describe(), on_stop=self.stop if stoppable else None,
                                            planned_steps=self.target_step, hint="" if stoppable else STOP_HINT)
        self.report: TrainReport | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._work: RankWork | None = None
        self.heals: list[str] = []  # what auto_heal did, in words
        self._healing: str | None = None
        self._displays: list = []  # notebook displays of this run, brought up to date when it ends

    # -- running ------------------------------------------------------------

    def start(self) -> "TrainingRun":
        if self.dashboard is not None:
            self.dashboard.show()
        self._begin()
        if self.background:
            threading.Thread(target=self._finish, name="labkit-training-run", daemon=True).start()
        else:
            self._wait_here()
        return self

    def _wait_here(self) -> None:
        """The foreground wait; with a Stop button, handling widget messages between ticks."""
        if self._ui_events is None:
            self._finish()
            return
        # One poller for the whole wait: cells queued meanwhile are held by it and run, in order, once
        # this cell ends; each widget message is handled once, by whichever poll reads it.
        with self._ui_events() as poll:
            self._ui_poll = poll
            try:
                self._finish()
            finally:
                self._ui_poll = None

    def _begin(self) -> None:
        ranks = list(range(self.session.world_size))
        self.session.control.request_stop(False)
        self._work = self.session.begin(
            ranks,
            entry.train,
            (self.config,),
            self.timeout,
            # In the background, rank output would land in whatever cell runs then: keep it. Under a
            # dashboard, progress goes to its status line instead of growing the cell without end.
            output=make_output(ranks, live=False if self.background else None, show_values=False,
                               silent=self.background or self.dashboard is not None),
            on_tick=self.tick,
            on_interrupt=self._wind_down,
        )

    @property
    def polling(self) -> bool:
        """Whether a foreground wait handles widget messages now (its Stop button's clicks)."""
        return self._ui_poll is not None

    def tick(self, work: RankWork) -> None:
        """One look at the ranks' work while it runs: merge the rows they published, redraw the dashboard."""
        for result in work.results.values():
            data = result.data if isinstance(result.data, dict) else {}
            self.table.merge(data.get("labkit_rows"))
        if self.dashboard is not None:
            self.dashboard.set_progress(_newest_line(getattr(work, "output", None)))
            self.dashboard.update()
        if self._ui_poll is not None:
            # Here, on the waiting thread after the redraw, a click never lands in the middle of one.
            self._ui_poll(UI_EVENTS_PER_TICK)

    def _finish(self) -> None:
        try:
            while True:
                work = self._work
                assert work is not None, "_begin sends the work before anything waits for it"
                reports = work.wait()
                self.session.release(self)  # the ranks are free again: recovery below may use them
                if not work.failed:
                    break
                error = self.session.failure(work, reports, self.timeout)
                self._mark_failure(error)
                if not self._heal(work, error):
                    for note in self.heals:  # what auto_heal did before it stopped, and why it stopped
                        error.add_note(f"auto_heal: {note}")
                    if self.heals:
                        print(f"labkit: {self.heals[-1]}", flush=True)
                    self.error = error
                    step = surviving_step(self.session)
                    if step is not None:  # the ranks kept the run's state: resume=True continues it
                        self.session.remember_training(self.config, step)
                    else:
                        self.session.last_training = None
                    self.session.remember_interrupted(Interrupted(
                        self.config, self.target_step, self.table.latest_step, self.background,
                        self.dashboard is not None, self.timeout, self.straggler_threshold))
                    break
            if self.error is None:
                # What wire.entry.train returns on each rank: its RankResult.
                results = [cast(RankResult, reports[rank]["value"]) for rank in range(self.session.world_size)]
                for result in results:
                    self.table.merge_rows(result["rows"])
                self.report = report = TrainReport(self.config, results, notes=tuple(self.heals))
                self.session.remember_training(self.config, self.config.first_step + report.steps_done)
                if report.stop_line is not None:  # stopped at a loss that was not finite: said as a failure
                    self.error = NonFiniteLoss(report.stop_line, report if report.steps_done else None)
                elif report.nonfinite_line is not None:
                    print(f"labkit: {report.nonfinite_line}", flush=True)
        except BaseException as error:  # kept for wait(); a background thread has nobody else to tell
            self.error = error
        finally:
            try:
                self.session.control.request_stop(False)
            except LabError:  # rank 0 is gone with its store; the next group's store starts empty
                pass
            self.session.release(self)
            if self.dashboard is not None:
                self.dashboard.set_progress(_newest_line(getattr(self._work, "output", None)))
                self.dashboard.finish(self.status())
            self._done.set()
            for handle in self._displays:  # the cell that showed the run shows how it ended
                handle.update({"text/plain": repr(self)}, raw=True)

    def _mark_failure(self, error) -> None:
        """Show on the dashboard which ranks died (or were replaced), after which step."""
        gone = sorted(set(getattr(error, "died", {})) | set(getattr(error, "replaced", ())))
        if self.dashboard is not None and gone:
            latest = self.table.latest_step
            self.dashboard.mark_failure(gone, 0 if latest is None else latest + 1)

    def _heal(self, work: RankWork, error) -> bool:
        """With auto_heal: go back to the last checkpoint on the repaired ranks and go on; whether it did."""
        config = self.config
        if not config.auto_heal or work.interrupted or not has_checkpoint(config):
            return False
        latest = self.table.latest_step
        failed_at = "?" if latest is None else latest + 1  # steps every rank had finished
        what = str(error).splitlines()[0]
        if len(self.heals) >= config.max_restarts:
            self.heals.append(f"gave up after {config.max_restarts} restarts (max_restarts): {what}")
            return False
        try:
            self._healing = f"healing, failed after step {failed_at}: {what}"
            self.config = continuation(self.session, config, self.target_step, self.timeout)
            self.session.claim(self)
            self._begin()
        except Exception as failure:  # noqa: BLE001 - the run ends with the original failure, said why
            self.heals.append(f"could not heal ({failure})")
            return False
        finally:
            self._healing = None
        self.table.new_segment()
        self.heals.append(f"{what} (after step {failed_at}); went on from the checkpoint at step "
                          f"{self.config.first_step} (restart {len(self.heals) + 1} of {config.max_restarts})")
        print(f"labkit: {self.heals[-1]}", flush=True)
        return True

    # -- control --------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> TrainReport:
        """Block until the run ends; return its report or raise its failure."""
        return super().wait(timeout)

    def status(self) -> str:
        # The outcome decides, not the done flag: the dashboard's last header is drawn just before it is set.
        if self.error is not None:
            step = self.table.latest_step
            where = f" after step {step + 1}" if step is not None else ""
            return f"failed{where}: {str(self.error).splitlines()[0]}"
        if self._healing:
            return self._healing
        report = self.report
        if report is None:
            step = self.table.latest_step
            return "starting" if step is None else f"running, step {step + 1} of {self.target_step}"
        if report.stopped_early:
            return f"stopped after step {self.config.first_step + report.steps_done} of {self.target_step}"
        return f"done: {report.steps_done} steps, loss {report.losses[-1]:.4f}"

    def __repr__(self) -> str:
        return f"<TrainingRun {self.config.describe()}: {self.status()}>"

    def _ipython_display_(self) -> None:
        """In a notebook: the repr in a display that is updated when the run ends (not a stale 'starting')."""
        from IPython.display import display

        handle = display({"text/plain": repr(self)}, raw=True, display_id=True)
        if handle is not None:
            self._displays.append(handle)
            if self._done.is_set():  # it ended while the display was being made
                handle.update({"text/plain": repr(self)}, raw=True)


def notebook_ui_events() -> UiEvents | None:
    """jupyter-ui-poll's ``ui_events`` where a blocked cell can handle widget messages with it; else None.

    Outside a Jupyter kernel (a script, a test, a terminal IPython) there are no widget messages: the run waits
    as before. jupyter-ui-poll reads them on ipykernel 6 only; ipykernel 7 receives shell messages on a thread
    of its own, where the poll finds none and a Stop button would do nothing, so it is not offered there.
    """
    if not in_kernel():
        return None
    try:
        from jupyter_ui_poll import ui_events
    except ImportError:
        return None
    return ui_events if pollable_kernel() else None


def pollable_kernel() -> bool:
    """Whether jupyter-ui-poll reaches this kernel's widget messages: ipykernel 6 (see above)."""
    try:
        from ipykernel import version_info
    except ImportError:
        return False
    major = version_info[0]  # ipykernel declares its parts as objects; the major is an int
    return isinstance(major, int) and major < 7


def _newest_line(output: LiveOutput | None) -> str:
    """The last line the lowest-numbered rank that printed anything printed, labelled (``[rank 0] ...``)."""
    texts = getattr(output, "texts", None)
    if texts is None:
        return ""
    for rank in texts.ranks:
        lines = [line for line in texts.stdout.get(rank, "").splitlines() if line.strip()]
        if lines:
            return f"[rank {rank}] {lines[-1]}"
    return ""
