"""What a ``lab.tasks`` call gives back: every task's record, a summary, and the error when some failed.

``runs.tasks`` fills these in as the queue runs; they are plain data the notebook
keeps (values, errors with their tracebacks, which rank ran each task and how often
a task was requeued after its rank was lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.spec.errors import LabError


class TaskFailed(LabError):
    """Some tasks raised; ``results`` holds every task's outcome, the finished ones included."""

    def __init__(self, message: str, results: "TaskResults") -> None:
        super().__init__(message)
        self.results = results


@dataclass
class TaskRecord:
    """One item's life in the queue."""

    index: int
    attempts: int = 0
    rank: int | str | None = None  # where it ran last (or runs now): a rank, or a site's "site:rank"
    started: float | None = None  # monotonic time its current attempt began running
    seconds: float | None = None  # how long the attempt that finished took on its rank
    state: str = "pending"  # pending, running, done, failed, cancelled
    value: object = None
    error: dict | None = None
    output: str = ""


@dataclass
class TaskResults:
    """What ``lab.tasks`` returns: values in item order, and how the work was shared."""

    records: list[TaskRecord]
    events: list[str] = field(default_factory=list)  # requeues and replacements, in order
    makespan: float = 0.0
    interrupted: bool = False

    @property
    def values(self) -> list:
        return [record.value for record in self.records]

    @property
    def done(self) -> int:
        return sum(record.state == "done" for record in self.records)

    @property
    def requeued(self) -> int:
        return sum(max(record.attempts - 1, 0) for record in self.records)

    def per_rank(self) -> dict:
        """Tasks finished by each rank (the lab's by number, a site's as "site:rank")."""
        counts: dict = {}
        for record in self.records:
            if record.state == "done" and record.rank is not None:  # (a task is done on the rank that reported it)
                counts[record.rank] = counts.get(record.rank, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (isinstance(item[0], str), str(item[0]).zfill(6))))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.values[index]

    def __iter__(self):
        return iter(self.values)

    def failures(self, why: str) -> list[TaskRecord]:
        """The failed tasks that ``why`` says: "raised", "lost" (their rank was lost more often than
        retries allow: a task that kills its rank) or "timed out"."""
        return [record for record in self.records if record.state == "failed" and _failure(record) == why]

    def summary(self) -> str:
        shares = ", ".join(f"rank {rank}: {count}" for rank, count in self.per_rank().items()) or "none"
        lines = [f"{self.done}/{len(self.records)} tasks done in {self.makespan:.2f} s; done by {shares}"]
        if self.requeued:
            lines.append(f"{self.requeued} task(s) requeued after their rank was lost")
        # A task that raised, one whose rank kept dying under it and one past its time are told apart:
        # only the first is an error of the task's own code.
        for why, said in (("raised", "raised"), ("timed out", "did not finish in time and were stopped"),
                          ("lost", "lost their rank on every try and were not requeued again (a task that ends its own "
                                   "process does this)")):
            failed = self.failures(why)
            if failed:
                lines.append(f"{len(failed)} task(s) {said}: {_tasks_and_ranks(failed)}")
        if self.interrupted:
            lines.append("interrupted: waiting tasks were withdrawn")
        return "\n".join(lines + self.events)

    def __repr__(self) -> str:
        return f"<TaskResults {self.summary().splitlines()[0]}>"


LOST = "LostRank"  # the error type of a task whose rank was lost more often than retries allow


def _failure(record: TaskRecord) -> str:
    kind = (record.error or {}).get("type")
    if kind == LOST:
        return "lost"
    if kind == "TimeoutError" and (record.error or {}).get("traceback") == "":
        return "timed out"  # stopped by the queue (a task's own TimeoutError has its traceback)
    return "raised"


def on_rank(record: TaskRecord) -> str:
    return f"on rank {record.rank}" if record.rank is not None else "on a rank lost before it was seen starting"


def _tasks_and_ranks(records: list[TaskRecord]) -> str:
    shown = ", ".join(f"task {record.index} {on_rank(record)}" for record in records[:5])
    return shown + (f" and {len(records) - 5} more" if len(records) > 5 else "")
