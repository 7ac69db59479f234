"""``RunHolder``: what owns a lab's ranks while long work runs on them; ``StoppableRun``: what runs
in the background share.

``Session.claim`` makes the ranks a holder's until ``Session.release``: a training
run (``runs.training_run.TrainingRun``) or a task queue (``runs.tasks.TaskQueue``).
While it holds them, other work is refused with the holder's status in words, and
stopping the lab asks the holder to end first and waits a while for it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from labkit.spec.errors import LabError


class RunHolder(Protocol):
    """Long work that holds the ranks: the session asks it these four things, nothing else."""

    @property
    def done(self) -> bool:
        """Whether it has ended (the ranks are no longer its own, even before ``release``)."""
        ...

    def status(self) -> str:
        """What it is doing now, in words (``LabBusy`` and ``lab.status`` say it)."""
        ...

    def stop(self) -> None:
        """End soon, at a point where the ranks are left whole (a training run: a step boundary)."""
        ...

    def finished(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for it to end; whether it has."""
        ...


STOP_GRACE_SECONDS = 15.0  # at least, for the ranks to reach a step boundary after an interrupt


class StoppableRun:
    """What a run on the ranks in the notebook's background shares (a training run, a watched script): a stop
    asked for at a step boundary, and the wait for its report. A subclass sets ``session``, ``_done``
    (a ``threading.Event``), ``error`` and ``report``, and says what is still going in ``_going()``."""

    session: Any
    table: Any  # the run's MetricsTable: its step times size the grace a stop gets
    _done: threading.Event
    error: BaseException | None
    report: Any

    def _going(self) -> str:
        return "the run"

    def _wind_down(self) -> float:
        """The kernel was interrupted: ask for a stop at a step boundary first; the seconds to give the ranks
        before they are interrupted (none when their store cannot be reached: rank 0 frozen or gone)."""
        try:
            self.stop()
        except LabError:
            return 0.0
        times = list(self.table.step_times().values())
        return max(STOP_GRACE_SECONDS, 10 * (times[-1] if times else 0.0))

    def stop(self) -> None:
        """Ask every rank to stop after the step it is in (they agree on which)."""
        if not self._done.is_set():
            self.session.control.request_stop(True)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finished(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the run to end; whether it has."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None):
        """Block until the run ends; return its report or raise its failure."""
        if not self._done.wait(timeout):
            raise LabError(f"{self._going()} is still going after {timeout:g} s; run.stop() ends it at the next step")
        if self.error is not None:
            raise self.error
        assert self.report is not None, "a run that ended without an error made its report"
        return self.report
