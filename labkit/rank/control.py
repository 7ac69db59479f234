"""Rank side of the control channel: the notebook's stop and slowdown requests, read between steps.

The notebook (``labkit.cluster.control``) writes into the process group's
rendezvous store. A rank asks the store for the request's version at most every
``POLL_SECONDS`` (one small round trip to rank 0), and reads the request only
when the version changed, so a training step pays almost nothing for it.

An injected slowdown is spent where the rank's work runs: on a CPU rank as a
busy-wait (a slow device computes; it does not sleep), on a GPU rank in its
compute stream (``rank.instruments.gpu_delay``), since a CPU running ahead of its GPU would
absorb a delay spent on the CPU and the step would not be slower.
"""

from __future__ import annotations

import json
import time

from labkit.wire.store_keys import REQUEST_KEY, SLOW_KEY, STOP_KEY, VERSION_KEY

POLL_SECONDS = 0.05


class ControlChannel:
    """This rank's view of the requests: ``stop_requested`` and its injected ``delay``."""

    def __init__(self, store, rank: int, poll_seconds: float = POLL_SECONDS, stream_delay=None) -> None:
        """``stream_delay``: a GPU rank's ``gpu_delay.StreamDelay`` (None: a CPU rank, which busy-waits)."""
        self.store = store  # a torch.distributed Store, or None: no requests can come
        self.rank = rank
        self.poll_seconds = poll_seconds
        self._version = 0
        self._next_poll = 0.0
        self.stop_requested = False
        self.delay = 0.0
        self._stream_delay = stream_delay

    def poll(self) -> None:
        if self.store is None or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + self.poll_seconds
        version = self.store.add(VERSION_KEY, 0)  # creates the counter at 0 if nobody wrote yet
        if version == self._version:
            return
        request = json.loads(self.store.get(REQUEST_KEY))
        self._version = version
        self.stop_requested = bool(request.get(STOP_KEY))
        self.delay = float(request.get(SLOW_KEY, {}).get(str(self.rank), 0.0))

    def spend_delay(self) -> float:
        """Spend the injected delay: in the GPU's stream, or busy on the CPU (a slow device computes)."""
        if self.delay <= 0:
            return 0.0
        if self._stream_delay is not None:
            return self._stream_delay.delay(self.delay)
        until = time.perf_counter() + self.delay
        while time.perf_counter() < until:
            pass
        return self.delay
