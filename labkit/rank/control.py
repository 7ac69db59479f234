"""Rank side of the control channel: the notebook's stop and slowdown requests, read at step boundaries.

The notebook (``labkit.cluster.control``) replaces a small JSON file atomically;
a rank checks its modification time every step, which costs one ``stat``, and
reads it only when it changed.
"""

from __future__ import annotations

import json
import os
import time

from labkit.cluster.control import SLOW_KEY, STOP_KEY


class ControlChannel:
    """This rank's view of the requests: ``stop_requested`` and its injected ``delay``."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._stamp = None
        self.stop_requested = False
        self.delay = 0.0

    def poll(self) -> None:
        if not self.path:
            return
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        request = {}
        if stamp is not None:
            try:
                with open(self.path) as handle:
                    request = json.load(handle)
            except (OSError, ValueError):
                return  # caught half-written: read it again next step, even if its time does not change
        self._stamp = stamp
        self.stop_requested = bool(request.get(STOP_KEY))
        self.delay = float(request.get(SLOW_KEY, {}).get(str(self.rank), 0.0))

    def spend_delay(self) -> float:
        """Busy-wait the injected delay (a slow device computes; it does not sleep)."""
        if self.delay <= 0:
            return 0.0
        until = time.perf_counter() + self.delay
        while time.perf_counter() < until:
            pass
        return self.delay
