"""The notebook's requests to work already running on the ranks: stop, slow a rank down.

A training step cannot be interrupted without breaking a collective, so the
notebook never signals a run to stop: it writes its requests where every rank
looks at each step boundary (``labkit.rank.control`` reads them). On one machine
that is a small JSON file in the lab's private directory, replaced atomically by
rename so a rank never reads half of it.
"""

from __future__ import annotations

import json
import os

from labkit.spec.errors import LabConfigError

# The file's keys, shared with ``labkit.rank.control``.
STOP_KEY = "stop"
SLOW_KEY = "slow"


class ControlRequests:
    """What the notebook currently asks of running work, and where the ranks read it."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.stop = False
        self.slow: dict[int, float] = {}

    def as_request(self) -> dict:
        return {STOP_KEY: self.stop, SLOW_KEY: {str(rank): seconds for rank, seconds in self.slow.items()}}

    def request_stop(self, stop: bool = True) -> None:
        self.stop = bool(stop)
        self.write()

    def set_slowdown(self, rank, seconds, world_size: int) -> str:
        """Slow ``rank`` by ``seconds`` per training step (None or 0: back to normal); say what changed."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise LabConfigError(f"rank must be between 0 and {world_size - 1}, got {rank!r}")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf")
        ):
            raise LabConfigError(f"the delay must be a finite number of seconds >= 0, got {seconds!r}")
        if seconds:
            self.slow[rank] = float(seconds)
            message = f"rank {rank} now takes {seconds * 1000:g} ms longer per training step"
        else:
            self.slow.pop(rank, None)
            message = f"rank {rank} runs at its own speed again"
        self.write()
        return message

    def write(self) -> None:
        """Replace the file in one step (a no-op before the ranks exist)."""
        if self.path is None or not os.path.isdir(os.path.dirname(self.path)):
            return
        partial = f"{self.path}.{os.getpid()}.tmp"
        with open(partial, "w") as handle:
            json.dump(self.as_request(), handle)
        os.replace(partial, self.path)
