"""What the instruments saw of a loop the lab did not write (``lab.run_script(..., instruments=True)``).

Built from every rank's ``LoopWatch.result()``; pure, no torch. The same numbers
as a ``TrainReport`` where a foreign loop has them: steps, the median step (the
slowest rank at each step, the first step left out), samples and tokens per
second (from the batches the data-parallel module saw, summed over ranks),
bytes per step by collective kind, memory per rank, stragglers, timelines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from labkit.units import format_bytes
from labkit.views.metrics import MetricsTable
from labkit.views.train_report import bytes_per_step
from labkit.wire.schema import LoopResult, StepRow, TimelineStep, total_bytes


@dataclass
class LoopReport:
    title: str  # what ran: the script and its arguments
    results: list[LoopResult]  # one per rank, in rank order
    stopped: bool = False  # a stop the notebook asked for ended it
    table: MetricsTable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.table = MetricsTable(len(self.results), None)
        for result in self.results:
            self.table.merge_rows(result["rows"])

    # -- steps ----------------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Steps every rank completed."""
        return min(len(result["rows"]) for result in self.results) if self.results else 0

    @property
    def rows(self) -> dict[int, list[StepRow]]:
        """Every rank's rows, by rank."""
        return {result["rank"]: list(result["rows"]) for result in self.results}

    @property
    def step_seconds(self) -> list[float]:
        """Per step: the slowest rank's time."""
        return [max(result["rows"][step]["seconds"] for result in self.results) for step in range(self.steps_done)]

    @property
    def median_step_seconds(self) -> float:
        """Median over steps, leaving out the first (it warms up); nan before any step."""
        times = self.step_seconds
        return statistics.median(times[1:] or times) if times else float("nan")

    def _steady(self, result: LoopResult) -> list[StepRow]:
        rows = result["rows"][: self.steps_done]
        return rows[1:] or rows

    def _per_step(self, name: Literal["samples", "tokens"]) -> float | None:
        """A row count (samples, tokens) summed over ranks, mean over steady steps; None where no rank has it."""
        totals = []
        for result in self.results:
            values = [count for row in self._steady(result) if (count := row[name]) is not None]
            if values:
                totals.append(statistics.fmean(values))
        return sum(totals) if totals else None

    @property
    def samples_per_step(self) -> float:
        """Samples all ranks' data-parallel modules saw in one step (0 where none was found)."""
        return self._per_step("samples") or 0.0

    @property
    def samples_per_second(self) -> float:
        return self.samples_per_step / self.median_step_seconds if self.steps_done else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        tokens = self._per_step("tokens")
        return None if tokens is None or not self.steps_done else tokens / self.median_step_seconds

    @property
    def comm_bytes_per_step(self) -> dict[str, int]:
        """Bytes through collectives in one step, by kind, summed over ranks (mean over steady steps)."""
        return bytes_per_step(self._steady(result) for result in self.results)

    @property
    def losses(self) -> list[float | None]:
        """Per step: the mean loss over the ranks that logged one (``labkit.log(loss=...)``), else None."""
        losses = []
        for step in range(self.steps_done):
            logged = [result["rows"][step]["loss"] for result in self.results
                      if result["rows"][step]["loss"] is not None]
            losses.append(statistics.fmean(logged) if logged else None)
        return losses

    @property
    def flagged(self) -> list[int]:
        """Ranks flagged as stragglers at the end, against the others (busy time per step)."""
        return self.table.flagged()

    @property
    def memory(self) -> list:
        """Per rank: parameters, gradients and optimizer state of what the loop wrapped (local shards)."""
        return [result["memory"] for result in self.results]

    @property
    def notes(self) -> list[str]:
        """What the instruments could not see, said once per kind over the ranks."""
        return list(dict.fromkeys(note for result in self.results for note in result.get("notes", ())))

    def timeline(self, steps: int | None = 4):
        """A Gantt picture of the last ``steps`` steps on every rank (``export_trace`` for Perfetto)."""
        from labkit.views.timeline import Timeline

        entries: dict[int, list[TimelineStep]] = {result["rank"]: result["timeline"] for result in self.results}
        if not all(entries.values()):
            raise ValueError("no step was seen on some rank: the loop made no optimizer step and marked none "
                             "with labkit.step()")
        shown = min(len(v) for v in entries.values())
        count = min(shown, steps) if steps else shown
        return Timeline(entries, steps, title=f"{self.title}: last {'step' if count == 1 else f'{count} steps'}")

    def export_trace(self, path: str, steps: int | None = None) -> str:
        """Write a Chrome/Perfetto trace of the last steps (all that were kept by default)."""
        return self.timeline(steps).export_trace(path)

    # -- words ------------------------------------------------------------------

    def summary_lines(self) -> list[str]:
        lines = [f"{self.title}: {self.steps_done} steps" + (" (stopped)" if self.stopped else "")]
        logged = [loss for loss in self.losses if loss is not None]
        if logged:
            lines.append(f"loss {logged[0]:.4f} -> {logged[-1]:.4f} (labkit.log)")
        if self.steps_done:
            speed = f"median step {self.median_step_seconds * 1000:.1f} ms"
            if self.samples_per_step:
                speed += f", {self.samples_per_second:,.0f} samples/s"
            tokens = self.tokens_per_second
            if tokens is not None:
                speed += f", {tokens:,.0f} tokens/s"
            lines.append(speed)
            comm = self.comm_bytes_per_step
            if comm:
                lines.append("per step: " + ", ".join(f"{kind} {format_bytes(size)}" for kind, size in comm.items()))
        largest = max((total_bytes(memory) for memory in self.memory), default=0)
        if largest:
            lines.append(f"largest rank's parameters, gradients and optimizer state: {format_bytes(largest)}")
        if self.flagged:
            lines.append("stragglers: " + ", ".join(f"rank {rank}" for rank in self.flagged))
        lines += [f"note: {note}" for note in self.notes]
        return lines

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))
