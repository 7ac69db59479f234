"""The notebook's view of where busy ranks are, read from the ranks' store while work runs.

Each rank publishes, while user work runs, its line in the user's code and what
its process groups issued, have in flight and wait for (``labkit.rank.whereabouts``),
as one JSON value under ``labkit/where/{rank}`` in the process group's
rendezvous store (served by rank 0, like the control requests of ``control``).
A ``WhereaboutsReader`` reads the values of one piece of work's ranks in a
thread of its own, so that a store that does not answer (rank 0 frozen) delays
nothing but the reading, and so that loading torch (the store's client) is
never on the notebook's path. Each value names the ipyparallel request it was
sampled for: a rank's value from an earlier cell is ignored.

The reader also carries the notebook's release requests: bumping
``labkit/release/{rank}`` makes that rank's thread close its group connections,
which frees a rank blocked in a collective that no idle peer could free.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

from labkit.wire.store_keys import RELEASE_KEY, WHERE_KEY

READ_SECONDS = 0.25
# The store answers in microseconds when rank 0 is well; a frozen rank 0 delays only this thread.
STORE_TIMEOUT_SECONDS = 1.0


class WhereaboutsReader:
    """The latest whereabouts of the ranks of one piece of work (``states``), read every ``READ_SECONDS``.

    ``work_ids``: rank -> the ipyparallel message id of its request. ``states``: rank -> the rank's
    latest value of this work, with ``seen_at`` added (``time.monotonic()`` here when that sample was
    first read). ``rounds`` counts the complete reads, so a caller can tell a new read from an old one."""

    def __init__(self, address: tuple[str, int], work_ids: dict[int, str]) -> None:
        self.address = address
        self.work_ids = dict(work_ids)
        self.ranks = frozenset(work_ids)  # the ranks still worth reading (``watch_only``)
        self.states: dict[int, dict] = {}
        self.rounds = 0
        self.problem: str | None = None  # why the last read failed, if it did
        self._releases: list[int] = []  # asked for, not yet written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labkit-whereabouts-reader", daemon=True)
        self._thread.start()

    def watch_only(self, ranks) -> None:
        """Read only ``ranks`` from now on (the others finished)."""
        self.ranks = frozenset(ranks)

    def request_release(self, ranks) -> None:
        """Have each of ``ranks`` close its group connections (written at the next read)."""
        with self._lock:
            self._releases.extend(ranks)

    def stop(self) -> None:
        self._stop.set()

    # -- the reading thread ----------------------------------------------------

    def _run(self) -> None:
        client = None
        while not self._stop.is_set():
            try:
                client = client or self._connect()
                self._write_releases(client)
                self._read(client)
                self.problem = None
            except (RuntimeError, OSError, ValueError) as error:  # torch's DistError is a RuntimeError
                client = None
                self.problem = str(error)
            self._stop.wait(READ_SECONDS)

    def _write_releases(self, client) -> None:
        with self._lock:
            ranks, self._releases = self._releases, []
        for rank in ranks:
            client.add(RELEASE_KEY.format(rank=rank), 1)

    def _read(self, client) -> None:
        states = dict(self.states)
        for rank in sorted(self.ranks):
            key = WHERE_KEY.format(rank=rank)
            if not client.check([key]):  # get would wait for it: the rank has published nothing yet
                continue
            state = json.loads(client.get(key))
            if state.get("work") != self.work_ids[rank]:
                continue  # from an earlier piece of work
            known = states.get(rank)
            if known is None or known.get("sampled") != state.get("sampled"):
                state["seen_at"] = time.monotonic()
                states[rank] = state
        self.states = states  # replaced whole: readers in other threads see one read or the next
        self.rounds += 1

    def _connect(self):
        host, port = self.address
        # torch's client retries a refused connection until its timeout: a plain connect says at once.
        socket.create_connection((host, port), timeout=STORE_TIMEOUT_SECONDS).close()
        import torch.distributed as dist  # loaded in this thread, only once work runs long enough to watch

        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS))
