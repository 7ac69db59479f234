"""The live view of a task queue: per rank what it runs and how many it finished.

In a notebook one display is redrawn a few times a second while ``lab.tasks``
runs: a line with pending, running and done counts, then a row per rank with
the task it is running, how many it has finished and whether it was replaced
(a dead rank's replacement rejoins the pool and takes tasks again). At the end
the display is emptied, so a saved notebook does not depend on timing, and the
queue prints its summary once. Outside a notebook nothing is drawn.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from labkit.views.rank_output import in_kernel

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

REDRAW_SECONDS = 0.25


def board_text(total: int, workers, records, rank_states: dict) -> str:
    """The board as text: counts, then one row per worker (a rank of the lab, or a site's "site:rank")."""
    states = [record.state for record in records]
    lines = [f"tasks: {states.count('pending')} pending, {states.count('running')} running, "
             f"{states.count('done')}/{total} done" + (f", {states.count('failed')} failed" if "failed" in states else "")]
    width = max([6, *(len(str(worker)) + 2 for worker in workers)])
    lines.append(f"{'rank':<{width}}{'running':<10}{'done':<6}state")
    for rank in workers:
        running = [str(record.index) for record in records if record.state == "running" and record.rank == rank]
        done = sum(record.state == "done" and record.rank == rank for record in records)
        bar = "#" * done
        # The queue knows replacements; what a rank does now is read from the tasks it holds.
        state = rank_states.get(rank, "ready")
        if state == "ready" and running:
            state = "running"
        lines.append(f"{str(rank):<{width}}{','.join(running) or '-':<10}{done:<6}{state:<9}{bar}")
    return "\n".join(lines)


class TaskBoard:
    """Redraws ``board_text`` in one notebook display while the queue runs."""

    def __init__(self, total: int, workers, live: bool | None = None) -> None:
        self.total = total
        self.workers = list(range(workers)) if isinstance(workers, int) else list(workers)
        self.live = in_kernel() if live is None else live
        self._handle: DisplayHandle | None = None
        self._last_draw = 0.0

    def show(self, records, rank_states: dict) -> None:
        if not self.live or time.monotonic() - self._last_draw < REDRAW_SECONDS:
            return  # the queue polls far more often than the board is drawn
        from IPython.display import display

        if self._handle is None:
            self._handle = display({"text/plain": ""}, raw=True, display_id=True)
        self._handle.update({"text/plain": board_text(self.total, self.workers, records, rank_states)}, raw=True)
        self._last_draw = time.monotonic()

    def finish(self) -> None:
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
