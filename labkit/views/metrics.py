"""The notebook's side of the live metrics: merge what ranks publish, derive what to draw.

Ranks publish windows of their newest step rows (``instruments.Publisher``);
``MetricsTable.merge`` keeps one row per (rank, step) whatever the overlap
between windows. Everything derived here is over a recent window of steps:
throughput per rank and in total, the step split into compute and exposed
communication, communication time and bytes by collective, the loss, injected
slowdowns, and straggler scores. Pure: no processes, no torch.

Stragglers: ``views.stragglers`` scores each rank's busy time against the
ranks that do the same work (one pipeline stage, one role), step by step, as
soon as every rank of a group has reported a step. On CPU ranks busy time here
is the main thread's CPU time (``cpu``): the run delay that ``compute`` also
counts is mostly the wait for a core after a collective, on a loaded machine
the same for every rank and several times the work itself, and it would drown
a slow rank's extra work. GPU rows score their device compute.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import Literal, overload

from labkit.views.stragglers import DEFAULT_THRESHOLD, DEFAULT_WINDOW, StragglerDetector, straggler_scores
from labkit.wire.schema import MemoryBytes, StepRow, StepWindow, total_bytes

__all__ = ["DEFAULT_THRESHOLD", "MetricsTable", "StepField", "StepMaybeNumber", "StepNumber", "straggler_scores"]

RECENT_STEPS = 10  # what "recent" means for the split, the collectives and the total throughput
# The step-row fields that hold a number on every row (``cpu``: on CPU ranks' rows), those that may be None,
# and both (one Literal: mypy checks a TypedDict key against a Literal, not against a union of them).
StepNumber = Literal["step", "rank", "start", "seconds", "compute", "exposed_comm", "samples", "delay", "cpu"]
StepMaybeNumber = Literal["tokens", "loss"]
StepField = Literal["step", "rank", "start", "seconds", "compute", "exposed_comm", "samples", "delay", "cpu",
                    "tokens", "loss"]


def busy_seconds(row: StepRow) -> float:
    """What straggler scores compare: CPU time on CPU ranks, device compute on GPU ranks."""
    return row.get("cpu", row["compute"])


class MetricsTable:
    """Every rank's step rows of one run, merged; derived series for the dashboard."""

    def __init__(
        self,
        world_size: int,
        global_batch: int | None,
        peers_of: Mapping[int, Hashable] | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.world_size = world_size
        self.global_batch = global_batch
        self.peers_of = peers_of or {}
        self.threshold = threshold
        self.window = window
        self.rows: dict[int, dict[int, StepRow]] = {rank: {} for rank in range(world_size)}
        self.memory: dict[int, MemoryBytes] = {}  # what each rank holds, where its windows say (a watched loop)
        self._sequence: dict[int, int] = {}
        self.detector = StragglerDetector(threshold, window)
        self._groups: dict[Hashable, list[int]] = defaultdict(list)
        for rank in range(world_size):
            self._groups[self.peers_of.get(rank, 0)].append(rank)
        self._scored_up_to: dict[Hashable, int] = {}  # group -> the newest step the detector has seen

    # -- input ------------------------------------------------------------

    def merge(self, message: StepWindow | None) -> int:
        """Add one published window ({rank, seq, rows}); return how many rows were new."""
        if not message:
            return 0
        rank, sequence = message["rank"], message["seq"]
        if sequence <= self._sequence.get(rank, 0):
            return 0
        self._sequence[rank] = sequence
        if "memory" in message:
            self.memory[rank] = message["memory"]
        known = self.rows.setdefault(rank, {})
        new = 0
        for row in message["rows"]:
            if row["step"] not in known:
                new += 1
            known[row["step"]] = row
        return new

    def new_segment(self) -> None:
        """The ranks start publishing afresh (a run went on after a failure): their sequences restart,
        and the steps they train again replace the ones they had sent."""
        self._sequence.clear()

    def merge_rows(self, rows: list[StepRow]) -> None:
        """Add final rows (a run's results) regardless of sequence numbers."""
        for row in rows:
            self.rows.setdefault(row["rank"], {})[row["step"]] = row

    # -- series -------------------------------------------------------------

    def largest_memory(self) -> int | None:
        """The most bytes of parameters, gradients and optimizer state any rank said it holds (None: unsaid)."""
        return max((total_bytes(held) for held in self.memory.values()), default=None)

    def ranks(self) -> list[int]:
        return sorted(self.rows)

    @overload
    def series(self, rank: int, field: StepNumber, last: int | None = None) -> tuple[list[int], list[float]]: ...
    @overload
    def series(self, rank: int, field: StepMaybeNumber, last: int | None = None
               ) -> tuple[list[int], list[float | None]]: ...

    def series(self, rank: int, field: StepField, last: int | None = None
               ) -> tuple[list[int], list[float]] | tuple[list[int], list[float | None]]:
        """(steps, ``field`` of this rank's row at each) over its ``last`` steps (all when None)."""
        steps = sorted(self.rows[rank])
        if last is not None:
            steps = steps[-last:]
        rows = [self.rows[rank][step] for step in steps]
        return [row["step"] for row in rows], [row[field] for row in rows]

    @property
    def latest_step(self) -> int | None:
        """The newest step every rank has reported (None until each has reported one)."""
        if not self.rows or not all(self.rows.values()):
            return None
        return min(max(rows) for rows in self.rows.values())

    def _recent(self, rank: int, count: int | None = None) -> list[StepRow]:
        count = count or RECENT_STEPS
        steps = sorted(self.rows[rank])
        # The first step warms up caches and allocators: leave it out once there are others.
        if len(steps) > 1 and steps[0] == 0:
            steps = steps[1:]
        return [self.rows[rank][step] for step in steps[-count:]]

    def throughput(self, rank: int, last: int | None = 2000) -> tuple[list[int], list[float]]:
        """Samples per second of this rank, per step (the ``last`` steps)."""
        steps, seconds = self.series(rank, "seconds", last)
        samples = self.series(rank, "samples", last)[1]
        return steps, [n / s if s > 0 else 0.0 for n, s in zip(samples, seconds)]

    def total_throughput(self) -> float:
        """Global batch over the median recent step time of the slowest rank. Without a global batch (a loop
        the lab did not write), the samples every rank's rows counted in those steps."""
        times = self.step_times()
        recent = list(times)[-RECENT_STEPS:]
        if not recent:
            return 0.0
        seconds = statistics.median(times[step] for step in recent)
        if self.global_batch is not None:
            return self.global_batch / seconds
        batch = statistics.median(sum(self.rows[rank][step]["samples"] for rank in self.rows) for step in recent)
        return batch / seconds

    def step_times(self) -> dict[int, float]:
        """{step: slowest rank's seconds} for steps every rank has reported."""
        common = set.intersection(*(set(rows) for rows in self.rows.values())) if self.rows else set()
        return {step: max(self.rows[rank][step]["seconds"] for rank in self.rows) for step in sorted(common)}

    def split(self) -> dict[int, tuple[float, float]]:
        """{rank: (compute, exposed communication)} mean seconds per recent step."""
        result: dict[int, tuple[float, float]] = {}
        for rank in self.ranks():
            rows = self._recent(rank)
            if rows:
                result[rank] = (
                    statistics.fmean(row["compute"] for row in rows),
                    statistics.fmean(row["exposed_comm"] for row in rows),
                )
        return result

    def bytes_per_rank(self) -> dict[int, float]:
        """{rank: bytes it moved through collectives and sends per step}, mean over recent steps.

        Shows who carries the traffic: under a parameter server, the servers."""
        result: dict[int, float] = {}
        for rank in self.ranks():
            rows = self._recent(rank)
            if rows:
                result[rank] = statistics.fmean(sum(row["bytes"].values()) for row in rows)
        return result

    def by_collective(self) -> dict[str, tuple[float, float]]:
        """{kind: (seconds, bytes)} per step, summed over ranks, mean over recent steps."""
        seconds: defaultdict[str, float] = defaultdict(float)
        sizes: defaultdict[str, float] = defaultdict(float)
        for rank in self.ranks():
            rows = self._recent(rank)
            for row in rows:
                for kind, value in row["comm"].items():
                    seconds[kind] += value / len(rows)
                for kind, value in row["bytes"].items():
                    sizes[kind] += value / len(rows)
        return {kind: (seconds[kind], sizes[kind]) for kind in sorted(set(seconds) | set(sizes))}

    def loss(self) -> tuple[list[int], list[float]]:
        """Mean over the ranks that computed a loss, per step."""
        by_step: defaultdict[int, list[float]] = defaultdict(list)
        for rows in self.rows.values():
            for step, row in rows.items():
                loss = row["loss"]
                if loss is not None:
                    by_step[step].append(loss)
        steps = sorted(by_step)
        return steps, [statistics.fmean(by_step[step]) for step in steps]

    def slow_events(self) -> list[tuple[int, int, float]]:
        """(rank, step, delay seconds) wherever a rank's injected delay changed (0 = removed)."""
        events = []
        for rank in self.ranks():
            previous = 0.0
            for step in sorted(self.rows[rank]):
                delay = self.rows[rank][step].get("delay", 0.0)
                if delay != previous:
                    events.append((rank, step, delay))
                    previous = delay
        return events

    def _detect(self) -> None:
        """Feed the detector each group's steps that all of its ranks have reported, oldest first.

        A step some rank never published (windows that overflowed) is skipped, never waited for."""
        for group, ranks in self._groups.items():
            done = self._scored_up_to.get(group, -1)
            newest = min((max(self.rows.get(rank) or (-1,)) for rank in ranks), default=-1)
            if newest <= done:
                continue
            for step in range(done + 1, newest + 1):
                if all(step in self.rows.get(rank, {}) for rank in ranks):
                    self.detector.observe(step, {rank: busy_seconds(self.rows[rank][step]) for rank in ranks})
            # Steps trained again after a failure (``new_segment``) are not scored a second time.
            self._scored_up_to[group] = newest

    def stragglers(self) -> dict[int, tuple[float, bool]]:
        """{rank: (score, flagged)}: busy time against like ranks, over the last steps reported."""
        self._detect()
        return self.detector.scores(self.ranks())

    def flagged(self) -> list[int]:
        self._detect()
        return self.detector.flagged()

    def flag_events(self) -> list[tuple[int, int, bool]]:
        """(rank, step, flagged) at each step where a rank's straggler flag rose or cleared."""
        self._detect()
        return list(self.detector.events)
