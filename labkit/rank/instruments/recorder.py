"""Per-step measurements on a rank: what it computed, what it waited for, what it sent.

``StepRecorder`` makes one row per training step:

- ``seconds``: wall time of the step;
- ``compute``: time the rank's main thread was busy, that is running on a CPU
  or ready to run and waiting for one (its CPU clock plus the kernel's run
  delay, from ``/proc/self/task/<tid>/schedstat``). On a machine with more
  ranks than cores, waiting for a core is part of the rank's work, not
  communication;
- ``exposed_comm``: the rest, ``seconds - compute``: time the main thread was
  blocked, waiting for a collective it could not overlap. DDP's all-reduces that
  finish during backward add nothing here; the last bucket the step waits for
  does;
- ``comm`` and ``bytes``: for each collective kind, the time from issue to
  completion (overlapped or not) and the bytes issued in the step, from the
  mesh's ``TimedGroup``s;
- ``cpu``: the main thread's CPU time alone. On a loaded machine the run delay
  in ``compute`` is mostly the wait for a core after each collective, alike on
  every rank; straggler scores compare this instead;
- ``samples``, ``tokens``, ``loss``, ``delay`` (an injected slowdown, see
  ``labkit.rank.control``), ``start`` (wall clock).

It also keeps, for the last steps, the intervals a timeline needs: each
collective's issue and completion, and the main thread's busy fraction between
consecutive moments it was sampled.

The CPU-clock method assumes the rank blocks only on communication (the zoo's
data is generated in memory). GPU ranks use ``gpu_instruments.CudaStepRecorder``
instead, which makes the same rows from CUDA events; ``recorders.recorder_for`` picks one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import deque

from labkit.wire.schema import StepRow

TIMELINE_STEPS = 12
ROW_CAPACITY = 100_000


class MainThreadClock:
    """Busy time (CPU + run delay) of the main thread, readable from any thread."""

    def __init__(self) -> None:
        main = threading.main_thread()
        assert main.ident is not None  # the main thread runs this process: it has started
        self._cpu_clock = time.pthread_getcpuclockid(main.ident)
        self._schedstat: int | None = None
        # The main thread leads its thread group, so its id is the process id. Not main.native_id:
        # in a process forked from another (the lab's ranks are), Python 3.11 keeps the parent's id
        # there, and the run delay (most of a slowed rank's step on a loaded machine) went unseen.
        try:
            self._schedstat = os.open(f"/proc/self/task/{os.getpid()}/schedstat", os.O_RDONLY)
        except OSError:
            pass  # no schedstat: busy time is CPU time alone

    def cpu(self) -> float:
        """CPU time alone: the rank's own work, without the waits for a core that ``busy`` adds."""
        return time.clock_gettime(self._cpu_clock)

    def busy(self) -> float:
        busy = time.clock_gettime(self._cpu_clock)
        if self._schedstat is not None:
            busy += int(os.pread(self._schedstat, 64, 0).split()[1]) / 1e9
        return busy

    def close(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None


def newest_rows(rows: deque, count: int) -> list[dict]:
    """The last ``count`` rows, without copying the whole buffer (this runs a few times a second)."""
    return list(itertools.islice(reversed(rows), count))[::-1]


class StepRecorder:
    """Rows of per-step measurements from CPU clocks; TimedGroups report collectives to it.

    The interface a TimedGroup and the loop use (``issued``, ``completed``,
    ``waiting``, ``backward_watch``, ``watch_module_waits``, ``begin_step``,
    ``end_step``, ``finish``, ``clear``) is shared
    with ``gpu_instruments.CudaStepRecorder``.
    """

    watches_waits = False  # the CPU clocks see a blocked thread without help

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows: deque = deque(maxlen=ROW_CAPACITY)
        self.clock = MainThreadClock()
        self._events: deque = deque()  # (kind, bytes, issued, completed), from any thread
        self._samples: deque = deque(maxlen=20_000)  # (perf time, busy seconds) for the timeline
        self.timeline: deque = deque(maxlen=TIMELINE_STEPS)
        self._step: tuple[int, float, float] | None = None  # (step, began, busy then) of the step under way
        self._issued = self._completed = 0
        self._sent: dict[str, int] = {}  # bytes issued in the step under way, by kind
        self._wall_offset = time.time() - time.perf_counter()

    # -- fed by TimedGroup (any thread) -------------------------------------

    paused = False  # True while labkit's own bookkeeping talks (progress lines): not the model's traffic

    def issued(self, device_type: str = "cpu", kind: str | None = None, nbytes: int = 0) -> float:
        """A collective is being issued: its bytes count in the step under way (at issue, not at completion:
        a completion that lands late on a loaded machine must not move them to the next step); note the main
        thread's busy time; return the issue time."""
        if kind is not None and not self.paused:
            self._sent[kind] = self._sent.get(kind, 0) + nbytes
        self._issued += 1
        now = time.perf_counter()
        self._samples.append((now, self.clock.busy()))
        return now

    def completed(self, kind: str, nbytes: int, issued: float) -> None:
        """A collective issued at ``issued`` has completed (called from any thread)."""
        completed = time.perf_counter()
        self._completed += 1
        if self.paused:
            return
        self._events.append((kind, nbytes, issued, completed))
        self._samples.append((completed, self.clock.busy()))

    def ran_in_stream(self, kind: str, nbytes: int, issued: float) -> None:
        """A collective answered no work: it ran inside the call (a blocked thread shows in the clocks)."""
        self.completed(kind, nbytes, issued)

    def waiting(self):
        return contextlib.nullcontext()

    def backward_watch(self, loss):
        return contextlib.nullcontext()  # a blocked main thread shows in the CPU clocks already

    def watch_module_waits(self, module) -> None:
        """Nothing to bracket: see ``backward_watch``."""

    def clear(self) -> None:
        self.rows.clear()
        self.timeline.clear()

    def finish(self) -> None:
        """Nothing is pending: CPU rows are complete when the step ends."""

    def _settle(self, limit: float = 0.005) -> None:
        """Let completion callbacks of collectives the step already waited for land in this step.

        A work's future is marked done before its callbacks run (on gloo's
        thread, which needs the GIL); without this, a collective could be
        counted in the next step.
        """
        deadline = time.perf_counter() + limit
        while self._completed < self._issued and time.perf_counter() < deadline:
            time.sleep(0.0002)
        self._issued = self._completed  # one that never completes must not slow every later step

    @contextlib.contextmanager
    def lab_traffic(self):
        """Within: collectives are the lab's own (a stop agreed between steps), not the loop's; their
        completions, which land on gloo's thread a moment after the wait, are let in before it ends. Those of
        the loop's own collectives still landing are let in first (an agreement inside a step, after backward)."""
        self._settle()
        self.paused = True
        try:
            yield
        finally:
            self._settle()
            self.paused = False

    # -- fed by the training loop (main thread) -----------------------------

    def begin_step(self, step: int) -> None:
        now = time.perf_counter()
        self._events.clear()  # collectives that completed before the step are not its own
        self._sent = {}  # nor are the bytes of those issued before it
        self._step = (step, now, self.clock.busy())
        self._cpu_began = self.clock.cpu()
        self._samples.clear()
        self._samples.append((now, self._step[2]))

    def end_step(self, samples: float, tokens: float | None, loss: float | None, delay: float = 0.0) -> StepRow:
        assert self._step is not None  # begin_step came first
        step, began, busy_began = self._step
        ended, busy_ended = time.perf_counter(), self.clock.busy()
        self._settle()
        seconds = ended - began
        compute = min(seconds, max(0.0, busy_ended - busy_began))
        events = []
        while self._events:
            events.append(self._events.popleft())
        comm: dict[str, float] = {}
        for kind, nbytes, issued, completed in events:
            comm[kind] = comm.get(kind, 0.0) + (completed - issued)
        sent, self._sent = self._sent, {}
        row: StepRow = {
            "step": step,
            "rank": self.rank,
            "start": began + self._wall_offset,
            "seconds": seconds,
            "compute": compute,
            "exposed_comm": seconds - compute,
            "comm": comm,
            "bytes": sent,
            "samples": samples,
            "tokens": tokens,
            "loss": None if loss is None else float(loss),
            "delay": delay,
            "cpu": self.clock.cpu() - self._cpu_began,
        }
        self.rows.append(row)
        self._samples.append((ended, busy_ended))
        self.timeline.append(self._timeline_entry(step, began, ended, events))
        return row

    def _timeline_entry(self, step: int, began: float, ended: float, events) -> dict:
        """Intervals of one step, in wall-clock seconds: busy fractions and collectives."""
        offset = self._wall_offset
        samples = sorted(self._samples)
        spans = []
        for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
            if t1 > t0:
                spans.append((t0 + offset, t1 + offset, max(0.0, min(1.0, (b1 - b0) / (t1 - t0)))))
        return {
            "step": step,
            "rank": self.rank,
            "start": began + offset,
            "end": ended + offset,
            "busy": spans,
            "collectives": [(kind, nbytes, issued + offset, completed + offset) for kind, nbytes, issued, completed in events],
        }

    def newest(self, count: int) -> list[dict]:
        return newest_rows(self.rows, count)


class Publisher:
    """Sends this rank's newest rows to the notebook a few times a second.

    ipyparallel keeps only the latest value per key, so each message is a window
    of the newest rows with a sequence number; the notebook merges by step.
    """

    def __init__(self, recorder: StepRecorder, interval: float = 0.25, window: int = 64, memory=None) -> None:
        """``memory``: a function giving what the rank holds now (``MemoryBytes``, or None while unknown),
        sent with each window."""
        self.recorder = recorder
        self.memory = memory
        self.interval = interval
        self.window = window
        self.sequence = 0
        self._last = 0.0
        try:
            from ipyparallel.datapub import publish_data
        except ImportError:
            publish_data = None
        self._publish = publish_data

    def maybe_publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self._publish is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        self.sequence += 1
        try:
            window = {"rank": self.recorder.rank, "seq": self.sequence, "rows": self.recorder.newest(self.window)}
            held = self.memory() if self.memory is not None else None
            if held is not None:
                window["memory"] = held
            self._publish({"labkit_rows": window})
        except Exception:  # outside an ipyparallel request (torchrun): nobody listens
            self._publish = None
