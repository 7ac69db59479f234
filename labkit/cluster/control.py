"""The notebook's requests to work already running on the ranks: stop, slow a rank down.

A training step cannot be interrupted without breaking a collective, so the
notebook never signals a run to stop: it writes its requests where every rank
looks between steps (``labkit.rank.control`` reads them). That place is the
process group's own rendezvous store, served by rank 0 on the lab's network:
it reaches every rank wherever its host is, and it needs no file shared
between machines. The notebook writes the whole request as one JSON value, then
bumps a version counter, so a rank that sees the new version reads a complete
request.

The notebook connects to the store only when it has something to say: a lab
that never stops a run early nor slows a rank never loads torch here.
"""

from __future__ import annotations

import json

from labkit.spec.errors import LabConfigError, LabError
from labkit.wire.store_client import store_client
from labkit.wire.store_keys import REQUEST_KEY, SLOW_KEY, STOP_KEY, VERSION_KEY

# The store answers in microseconds when rank 0 is well; a frozen rank 0 must not freeze the notebook.
WRITE_TIMEOUT_SECONDS = 5.0


def check_slowdown(rank, seconds, world_size: int, limit: float) -> None:
    """Refuse a rank that is not one, or a delay that is not a duration or reaches ``limit`` (the lab's time
    limit for work: a step slowed that much makes every later run time out)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise LabConfigError(f"rank must be between 0 and {world_size - 1}, got {rank!r}")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < limit
    ):
        raise LabConfigError(f"the delay is a number of seconds from 0 up to, not including, the lab's time limit "
                             f"({limit:g} s: a step slowed that much would make every run time out), got "
                             f"{seconds!r}; e.g. 0.03 (%lab slow {rank} 30ms)")


class ControlRequests:
    """What the notebook currently asks of running work, and the store where the ranks read it."""

    def __init__(self) -> None:
        self.stop = False
        self.slow: dict[int, float] = {}
        self.address: tuple[str, int] | None = None
        self._client = None

    def as_request(self) -> dict:
        return {STOP_KEY: self.stop, SLOW_KEY: {str(rank): seconds for rank, seconds in self.slow.items()}}

    def attach(self, host: str | None, port: int | None) -> None:
        """The ranks' store is now at ``host:port`` (a new process group); None (both): no ranks.

        A fresh store holds no requests: the standing ones (slowdowns) are written again."""
        self._client = None
        self.address = None if host is None or port is None else (host, int(port))
        if self.address is not None and (self.stop or self.slow):
            self.write()

    def request_stop(self, stop: bool = True) -> None:
        if bool(stop) == self.stop:
            return  # nothing changes: do not touch the store (a run's start and end call this)
        self.stop = bool(stop)
        self.write()

    def set_slowdown(self, rank, seconds, world_size: int, limit: float) -> str:
        """Slow ``rank`` by ``seconds`` per training step (None or 0: back to normal); say what changed."""
        check_slowdown(rank, seconds, world_size, limit)
        if seconds:
            self.slow[rank] = float(seconds)
            message = f"rank {rank} now takes {seconds * 1000:g} ms longer per training step"
        else:
            self.slow.pop(rank, None)
            message = f"rank {rank} runs at its own speed again"
        self.write()
        return message

    def forget_ranks_from(self, world_size: int) -> None:
        """The lab shrank: requests for ranks that no longer exist go."""
        self.slow = {rank: seconds for rank, seconds in self.slow.items() if rank < world_size}

    def write(self) -> None:
        """Put the request in the store (a no-op while no ranks are attached)."""
        if self.address is None:
            return
        try:
            client = self._connect()
            client.set(REQUEST_KEY, json.dumps(self.as_request()))
            client.add(VERSION_KEY, 1)
        except (RuntimeError, OSError) as error:  # torch's DistError is a RuntimeError
            self._client = None
            host, port = self.address
            raise LabError(f"the request could not reach the ranks' store at {host}:{port} ({error}); "
                           "rank 0 may be frozen or gone: %lab status tells, lab.heal() replaces it") from None

    def _connect(self):
        if self._client is None:
            self._client = store_client(*self.address, WRITE_TIMEOUT_SECONDS)  # torch: only a lab that sends requests
        return self._client
