"""``RunHolder``: what owns a lab's ranks while long work runs on them.

``Session.claim`` makes the ranks a holder's until ``Session.release``: a training
run (``runs.training_run.TrainingRun``) or a task queue (``runs.tasks.TaskQueue``).
While it holds them, other work is refused with the holder's status in words, and
stopping the lab asks the holder to end first and waits a while for it.
"""

from __future__ import annotations

from typing import Protocol


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
