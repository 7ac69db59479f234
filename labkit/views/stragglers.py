"""Straggler detection: which rank is busy for longer than the ranks that do the same work.

In synchronous training every rank's *step* takes as long as the slowest rank's
(the others wait in a collective), so step time cannot tell who is slow; busy
time can. ``StragglerDetector`` is fed one step at a time with the busy seconds
of a group of like ranks (one pipeline stage, one role) and decides, at that
step, which of them straggle:

- each rank's *ratio* at a step is its busy time over the median busy time of
  the *other* ranks of its group at the same step. Comparing within a step
  cancels what slows every rank at once (a busy machine, a long step);
- its *score* is the median of its last ``window`` ratios (8 steps): a short
  window, so a slowdown shows within a few steps, and a median, so one
  preempted step does not;
- it is flagged when its score reaches the *bar*, and the flag clears once the
  score falls below halfway between 1 and the bar (hysteresis: a score hovering
  at the bar does not blink).

The bar is the threshold (1.15 by default: a rank whose busy time rose 20%
against its peers is flagged), raised to what the machine's noise allows. On a
shared machine a rank's busy time wanders from step to step, and for a few
steps at a time by 30-40%; a bar below that would flag clean runs. The noise
is measured as it goes: the median absolute step-to-step change of each rank's
ratio (robust to a rank's own lasting slowdown, which changes it only once),
the median over the group, over its last 64 steps. The bar is at least
``1 + NOISE_MARGIN x`` that. A quiet machine keeps the threshold; a loaded
two-core machine raises the bar to about 1.5.

Pure: no processes, no torch, no clocks. The same steps give the same flags,
whenever and in whatever batches their rows arrive.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

DEFAULT_THRESHOLD = 1.15
THRESHOLD_RANGE = (1.0, 10.0)  # above the first, at most the second
DEFAULT_WINDOW = 8
MIN_STEPS = 4  # a rank is scored once it has this many ratios (the window may not be full yet)
NOISE_STEPS = 64  # the recent steps the noise is measured over
# The bar's distance from 1, in step-to-step changes of the ratio (median absolute, per sqrt(2), so about
# 0.67 standard deviations of one step's ratio each). On a loaded two-core machine clean runs have bursts
# of 8-14 steps at 1.3-1.4x, some 7 of these above 1: 10 keeps them below the bar.
NOISE_MARGIN = 10.0


def check_threshold(value) -> float:
    """The straggler threshold as a float, or ValueError saying the allowed range."""
    low, high = THRESHOLD_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise ValueError(
            f"straggler_threshold is how many times the busy time of like ranks flags a rank: a number above "
            f"{low:g} and at most {high:g} (default {DEFAULT_THRESHOLD:g}: 15% busier), got {value!r}"
        )
    return float(value)


class StragglerDetector:
    """Scores and flags per rank, updated one step at a time; ``events`` says when flags rose and cleared."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW) -> None:
        self.threshold = check_threshold(threshold)
        self.window = window
        self._ratios: dict[int, deque] = {}
        self._scores: dict[int, float] = {}
        self._flagged: set[int] = set()
        self.bars: dict[tuple[int, ...], float] = {}  # group (its ranks) -> the bar at its latest step
        self.events: list[tuple[int, int, bool]] = []  # (rank, step, flagged) where a flag rose or cleared

    def observe(self, step: int, busy: dict[int, float]) -> None:
        """One step of one group of like ranks: {rank: busy seconds}. A rank alone is never scored."""
        if len(busy) < 2:
            return
        for rank, seconds in busy.items():
            reference = statistics.median(value for other, value in busy.items() if other != rank)
            ratio = seconds / reference if reference > 0 else 1.0
            self._ratios.setdefault(rank, deque(maxlen=NOISE_STEPS)).append(ratio)
        bar = max(self.threshold, 1.0 + NOISE_MARGIN * statistics.median(_jitter(self._ratios[rank]) for rank in busy))
        self.bars[tuple(sorted(busy))] = bar
        release = 1.0 + (bar - 1.0) / 2
        for rank in busy:
            ratios = self._ratios[rank]
            if len(ratios) < MIN_STEPS:
                continue
            score = statistics.median(list(ratios)[-self.window:])
            self._scores[rank] = score
            if rank in self._flagged and score < release:
                self._flagged.discard(rank)
                self.events.append((rank, step, False))
            elif rank not in self._flagged and score >= bar:
                self._flagged.add(rank)
                self.events.append((rank, step, True))

    def scores(self, ranks) -> dict[int, tuple[float, bool]]:
        """{rank: (score, flagged)}; a rank not scored yet (or alone in its group) has (1.0, False)."""
        return {rank: (self._scores.get(rank, 1.0), rank in self._flagged) for rank in ranks}

    def flagged(self) -> list[int]:
        return sorted(self._flagged)


def _jitter(ratios) -> float:
    """Typical step-to-step change of a ratio (median absolute difference over sqrt 2): a lasting
    change of level moves it once, noise at every step."""
    values = list(ratios)
    changes = [abs(b - a) for a, b in zip(values, values[1:])]
    return statistics.median(changes) / math.sqrt(2) if changes else 0.0


def straggler_scores(
    busy_by_rank: dict[int, list[float]],
    peers_of: dict[int, object],
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
) -> dict[int, tuple[float, bool]]:
    """{rank: (score, flagged)} from each rank's busy seconds per step, oldest first, the newest steps
    aligned (the lists' ends are the same step). ``peers_of`` maps a rank to the group it is compared
    within (default: one group)."""
    detector = StragglerDetector(threshold, window)
    groups: dict[object, list[int]] = {}
    for rank in busy_by_rank:
        groups.setdefault(peers_of.get(rank, 0), []).append(rank)
    for ranks in groups.values():
        length = min(len(busy_by_rank[rank]) for rank in ranks)
        for index in range(length):
            detector.observe(index, {rank: busy_by_rank[rank][index - length] for rank in ranks})
    return detector.scores(busy_by_rank)
