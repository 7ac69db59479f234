"""Where this rank is while user work runs, published for the notebook; and a way out of a deadlock.

Runs in the engines. One daemon thread per rank (started by the runtime) wakes
every ``SAMPLE_SECONDS`` while user work runs and reads, without stopping the
work:

- the line of the user's code the working thread is at: its innermost frame in
  a ``%%lab`` cell, a ``lab.run_cell`` or the running script, with the line's text;
- what each process group issued, has in flight and waits for (``LabGroups.state()``).

It publishes them as one JSON value under ``labkit/where/{rank}`` in the ranks'
rendezvous store, only when they changed and every ``HEARTBEAT_SECONDS`` (so the
notebook knows the thread lives). The value names the ipyparallel request the
work came in, so the notebook never mistakes an earlier cell's value for this
one's. The notebook (``runs.dispatch``) names deadlocks from these values
(``runs.deadlock``) and shows them in ``lab.status()``.

A rank blocked in a collective that no peer will join cannot free itself, and
when every rank is blocked no idle peer can close its connections for it. So the
thread also watches ``labkit/release/{rank}``: when the notebook bumps it during
this work, the thread closes this rank's group connections (``LabGroups.release``)
and the blocked wait fails at once with "connection closed"; the rank lives on.

What it costs the work: the thread holds the GIL a few microseconds per sample
(a stack walk, a copy of small dicts); store calls release it. It has a store
client of its own: torch's client serialises its calls, and one that waits on a
frozen rank 0 (up to ``STORE_TIMEOUT_SECONDS``) must never hold up the main thread.
The store is a new one whenever the lab forms its world anew; the thread follows it.
"""

from __future__ import annotations

import json
import linecache
import sys
import threading
import time
from dataclasses import dataclass

from labkit.wire.store_client import store_client
from labkit.wire.store_keys import RELEASE_KEY, WHERE_KEY

SAMPLE_SECONDS = 0.2
HEARTBEAT_SECONDS = 1.0
STORE_TIMEOUT_SECONDS = 2.0
# Code the user wrote: cells sent by %%lab and lab.run_cell (see RankRuntime.run_cell).
USER_FILES = ("<lab cell In[", "<lab.run_cell")


def current_work_id() -> str | None:
    """The ipyparallel message id of the request being run (the notebook's AsyncResult has it), or None."""
    try:
        from IPython import get_ipython

        return get_ipython().kernel.get_parent("shell")["header"]["msg_id"]
    except Exception:  # noqa: BLE001 - not in an engine (tests, torchrun): the work has no id
        return None


def group_state() -> dict:
    """This rank's process groups now: for the notebook, about ranks that are not in the work."""
    from labkit.wire.current import this_rank

    return this_rank().groups.state()


@dataclass(frozen=True)
class _Work:
    thread: int  # the thread running the user's code
    work_id: str | None
    engine_main: object  # __main__ when the work began: a different one is a running script's


class Whereabouts:
    """The sampling thread of one rank; ``began``/``ended`` bracket user work (main thread, no I/O)."""

    def __init__(self, runtime, sample_seconds: float = SAMPLE_SECONDS) -> None:
        self.runtime = runtime
        self.sample_seconds = sample_seconds
        self.enabled = True  # False: nothing is sampled (to measure what sampling costs)
        self._work: _Work | None = None
        self._depth = 0  # user work may call user work (a cell calling lab functions): the outermost counts
        self._wake = threading.Event()
        self._client = None
        self._client_of: tuple[str, int] | None = None
        self._ticked: _Work | None = None  # the work the release counter's baseline was read for
        self._release_seen = 0
        self._released = 0
        self._published: dict | None = None
        self._published_at = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="labkit-whereabouts", daemon=True)
            self._thread.start()

    def began(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._work = _Work(threading.get_ident(), current_work_id(), sys.modules.get("__main__"))
            self._wake.set()

    def ended(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._work = None

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            work = self._work
            if work is None or not self.enabled:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._tick(work)
            except Exception:  # noqa: BLE001 - the store went (a world forming anew) or hung: connect again
                self._client = None  # the same store again keeps the release baseline: no bump is lost
            time.sleep(self.sample_seconds)

    def _tick(self, work: _Work) -> None:
        client = self._connected()
        if client is None:
            return
        rank = self.runtime.rank
        release_key = RELEASE_KEY.format(rank=rank)
        requested = client.add(release_key, 0)  # creates the counter at 0 if the notebook never wrote it
        if work is not self._ticked:
            # Bumps from before this work (asked while an earlier one ended) are not for it.
            self._ticked, self._release_seen, self._published = work, requested, None
        elif requested != self._release_seen:
            self._release_seen = requested
            self.runtime.groups.release()
            self._released += 1
        try:
            sample = self.sample(work)
        except RuntimeError:  # the work made a group while its groups were copied: next time
            return
        now = time.monotonic()
        if sample != self._published or now - self._published_at >= HEARTBEAT_SECONDS:
            client.set(WHERE_KEY.format(rank=rank), json.dumps({**sample, "sampled": time.time()}))
            self._published, self._published_at = sample, now

    def sample(self, work: _Work) -> dict:
        """What the notebook is told: the work, the user's line, the groups (plain data)."""
        groups = self.runtime.groups
        world = groups.handles.get(groups.world) if groups.world is not None else None
        return {"work": work.work_id, "rank": self.runtime.rank, "generation": self.runtime.generation,
                "where": self._user_line(work), "world": world.name if world is not None else None,
                "groups": groups.state(), "released": self._released,
                "stopped": self.runtime.debugging.stopped,  # at a breakpoint (rank.debugger): where, and the stop
                "iterating": self.runtime.model_steps.iterating}  # a DDP model trains: a stop can wait for its forward

    def _user_line(self, work: _Work) -> dict | None:
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None) if main is not work.engine_main else None
        frame = sys._current_frames().get(work.thread)
        try:
            while frame is not None:  # innermost first: the user's own line, not the cell line calling it
                filename = frame.f_code.co_filename
                if filename.startswith(USER_FILES) or (script is not None and filename == script):
                    line = frame.f_lineno
                    return {"file": filename, "line": line, "text": linecache.getline(filename, line).strip()}
                frame = frame.f_back
            return None
        finally:
            del frame  # a frame kept here would keep the work's locals alive

    def _connected(self):
        """This thread's client of the runtime's store now (a new world has a new store), or None."""
        store = self.runtime.store
        if store is None:
            return None
        address = (store.host, store.port)
        if self._client is None or self._client_of != address:
            self._client = None
            self._client = store_client(*address, STORE_TIMEOUT_SECONDS)
            if address != self._client_of:  # a new store counts releases from 0: read the baseline again
                self._client_of, self._ticked = address, None
        return self._client
