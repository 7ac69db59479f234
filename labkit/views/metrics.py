"""The notebook's side of the live metrics: merge what ranks publish, derive what to draw.

Ranks publish windows of their newest step rows (``instruments.Publisher``);
``MetricsTable.merge`` keeps one row per (rank, step) whatever the overlap
between windows. Everything derived here is over a recent window of steps:
throughput per rank and in total, the step split into compute and exposed
communication, communication time and bytes by collective, the loss, injected
slowdowns, and straggler scores. Pure: no processes, no torch.

Straggler score: a rank's busy time per step (its rolling median over the last
``window`` steps) divided by the median of the same over the ranks that do the
same work. In synchronous training every rank's *step* takes as long as the
slowest one (the others wait in a collective), so the step time cannot tell who
is slow; busy time can. Ranks compare with ranks of the same pipeline stage,
whose work is alike; a stage alone in its kind is never scored.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

DEFAULT_THRESHOLD = 1.5
DEFAULT_WINDOW = 5


def straggler_scores(
    busy_by_rank: dict[int, list[float]],
    peers_of: dict[int, int],
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
) -> dict[int, tuple[float, bool]]:
    """{rank: (score, flagged)} from each rank's recent busy seconds per step.

    ``peers_of`` maps a rank to the group it is compared within (its pipeline
    stage); ranks with fewer than ``window`` steps, or alone in their group, get
    a score of 1.0.
    """
    recent = {
        rank: statistics.median(times[-window:]) for rank, times in busy_by_rank.items() if len(times) >= window
    }
    groups = defaultdict(list)
    for rank, value in recent.items():
        groups[peers_of.get(rank, 0)].append(value)
    scores = {}
    for rank in busy_by_rank:
        group = groups.get(peers_of.get(rank, 0), [])
        if rank not in recent or len(group) < 2:
            scores[rank] = (1.0, False)
            continue
        reference = statistics.median(group)
        score = recent[rank] / reference if reference > 0 else 1.0
        scores[rank] = (score, score > threshold)
    return scores


class MetricsTable:
    """Every rank's step rows of one run, merged; derived series for the dashboard."""

    def __init__(
        self,
        world_size: int,
        global_batch: int,
        peers_of: dict[int, int] | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.world_size = world_size
        self.global_batch = global_batch
        self.peers_of = peers_of or {}
        self.threshold = threshold
        self.window = window
        self.rows: dict[int, dict[int, dict]] = {rank: {} for rank in range(world_size)}
        self._sequence: dict[int, int] = {}

    # -- input ------------------------------------------------------------

    def merge(self, message: dict | None) -> int:
        """Add one published window ({rank, seq, rows}); return how many rows were new."""
        if not message:
            return 0
        rank, sequence = message["rank"], message["seq"]
        if sequence <= self._sequence.get(rank, 0):
            return 0
        self._sequence[rank] = sequence
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

    def merge_rows(self, rows: list[dict]) -> None:
        """Add final rows (a run's results) regardless of sequence numbers."""
        for row in rows:
            self.rows.setdefault(row["rank"], {})[row["step"]] = row

    # -- series -------------------------------------------------------------

    def ranks(self) -> list[int]:
        return sorted(self.rows)

    def series(self, rank: int, field: str, last: int | None = None) -> tuple[list[int], list[float]]:
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

    def _recent(self, rank: int, count: int | None = None) -> list[dict]:
        count = count or 2 * self.window
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
        """Global batch over the median recent step time of the slowest rank."""
        times = self.step_times()
        recent = list(times.values())[-2 * self.window :]
        return self.global_batch / statistics.median(recent) if recent else 0.0

    def step_times(self) -> dict[int, float]:
        """{step: slowest rank's seconds} for steps every rank has reported."""
        common = set.intersection(*(set(rows) for rows in self.rows.values())) if self.rows else set()
        return {step: max(self.rows[rank][step]["seconds"] for rank in self.rows) for step in sorted(common)}

    def split(self) -> dict[int, tuple[float, float]]:
        """{rank: (compute, exposed communication)} mean seconds per recent step."""
        result = {}
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
        result = {}
        for rank in self.ranks():
            rows = self._recent(rank)
            if rows:
                result[rank] = statistics.fmean(sum(row["bytes"].values()) for row in rows)
        return result

    def by_collective(self) -> dict[str, tuple[float, float]]:
        """{kind: (seconds, bytes)} per step, summed over ranks, mean over recent steps."""
        seconds, sizes = defaultdict(float), defaultdict(float)
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
        by_step = defaultdict(list)
        for rows in self.rows.values():
            for step, row in rows.items():
                if row["loss"] is not None:
                    by_step[step].append(row["loss"])
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

    def stragglers(self) -> dict[int, tuple[float, bool]]:
        busy = {rank: self.series(rank, "compute", 4 * self.window)[1] for rank in self.ranks()}
        return straggler_scores(busy, self.peers_of, self.window, self.threshold)

    def flagged(self) -> list[int]:
        return [rank for rank, (_, flagged) in self.stragglers().items() if flagged]
