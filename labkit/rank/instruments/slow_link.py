"""Rank side of ``lab.link``: the lab's collectives complete as late as a slow link would make them.

Runs in the engines. The notebook sends a ``spec.link.LinkSpec`` (or None) with
``entry.set_link``; ``apply_link`` keeps it in the rank's ``LinkState``, which
every ``TimedGroup`` of the rank consults when it issues work. The real
collective runs at the machine's speed; its *completion* is then held back by
the time the link model gives (``LinkSpec.seconds``), so:

- the issuing thread is never blocked by an asynchronous collective: DDP still
  overlaps its bucketed all-reduces with the rest of backward, and only waits
  where it waits anyway, on the work's future;
- the recorder sees the collective complete later (its completion callback is
  attached to the held-back future), and a thread blocked on it is not busy,
  so the added time counts as communication in the training rows;
- a collective that fails (a peer died) fails at once, with nothing added.

The link is one per rank (``Wire``): a collective is carried once the one
before it has been, each for its own modelled time, by one thread that
completes the held-back futures when their time comes. Sends and receives have
no future (gloo): their ``wait`` crosses the link instead.

What is slowed: every process group of the rank. Each is a TimedGroup handle
(``rank.lab_groups``) made with the rank's LinkState: the world group, which
``dist.all_reduce(t)`` in a cell, ``lab.bench_collective`` and torchrun-style
scripts use, the groups of the lab's meshes (training runs with or without
instruments, the ``mesh`` of cells), and the groups a cell makes itself
(``dist.new_group``, a mesh of its own). Nothing touches the host's network.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from labkit.rank.instruments.gpu_delay import StreamDelay
from labkit.rank.instruments.timed_group import instrument_mesh
from labkit.rank.instruments.timed_work import TimedWork


class QuietRecorder:
    """A recorder that notes nothing: for groups slowed by the link on runs without instruments."""

    watches_waits = False
    paused = False
    quiet = True  # an instrumented mesh that shares the group takes it over (timed_group.instrument_mesh)

    def issued(self, device_type: str = "cpu", kind: str | None = None, nbytes: int = 0):
        return None

    def completed(self, kind: str, nbytes: int, issued) -> None:
        """Nothing is kept."""

    def ran_in_stream(self, kind: str, nbytes: int, issued) -> None:
        """Nothing is kept."""

    def waiting(self):
        return contextlib.nullcontext()


class Wire:
    """One rank's link: carries one collective at a time and completes each when it has been carried."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._free_at = 0.0  # perf_counter time when the link has carried everything given to it
        self._due: deque = deque()  # (deadline, finish), in deadline order
        self._thread: threading.Thread | None = None

    def _reserve(self, seconds: float) -> float:
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + seconds
        return self._free_at

    def carry(self, seconds: float, finish) -> None:
        """Call ``finish()`` once the link has carried this collective (on the wire's thread)."""
        with self._changed:
            self._due.append((self._reserve(seconds), finish))  # reserved under the lock: deadlines stay ordered
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="labkit-slow-link", daemon=True)
                self._thread.start()
            self._changed.notify()

    def cross(self, seconds: float) -> None:
        """Block the calling thread until the link has carried this message (sends and receives)."""
        with self._changed:
            done = self._reserve(seconds)
        while (left := done - time.perf_counter()) > 0:
            time.sleep(left)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._due:
                    self._changed.wait()
                deadline, finish = self._due[0]
                left = deadline - time.perf_counter()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._due.popleft()
            try:
                finish()
            except Exception:  # noqa: BLE001 - a future nobody waits for any more must not stop the link
                pass


class SlowWork(dist.Work):
    """A collective's work whose future completes when the link has carried it."""

    def __init__(self, inner: dist.Work, future: torch.futures.Future, recorder) -> None:
        super().__init__()
        self.inner = inner
        self.future = future
        self.recorder = recorder
        # A Python wait on the link is interruptible (a cell may be stopped while a slow link carries a
        # large buffer); a future's own wait is not, until it completes.
        self._carried = threading.Event()
        future.then(lambda _: self._carried.set())

    def wait(self, timeout=None) -> bool:
        # The real work's own limit (the group's timeout) bounds this too: its failure fails the future.
        with self.recorder.waiting():
            self._carried.wait()
            self.future.wait()  # at once now: raises the collective's error, joins the streams on a GPU
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done() and self.inner.is_success()

    def exception(self):
        return self.inner.exception()

    def get_future(self):
        return self.future

    def result(self):
        return self.inner.result()


class SlowMessageWork(TimedWork):
    """A send or receive: its ``wait`` returns once the real one is done and the link has carried it."""

    def __init__(self, inner: dist.Work, recorder, on_done, wire: Wire, seconds: float) -> None:
        super().__init__(inner, recorder, on_done)
        self.wire = wire
        self.seconds = seconds
        self._crossed = False

    def wait(self, timeout=None) -> bool:
        with self.recorder.waiting():
            result = self.inner.wait() if timeout is None else self.inner.wait(timeout)
            if not self._crossed:
                self._crossed = True
                self.wire.cross(self.seconds)
        if self.on_done is not None:
            self.on_done()
            self.on_done = None
        return result


def _cuda_device(tensors):
    if isinstance(tensors, torch.Tensor):
        return tensors.device if tensors.device.type == "cuda" else None
    if isinstance(tensors, (list, tuple)) and tensors:
        return _cuda_device(tensors[0])
    return None


class LinkState:
    """This rank's simulated link: the setting (None: off) and its wire."""

    def __init__(self) -> None:
        self.spec = None  # spec.link.LinkSpec
        self.wire = Wire()
        self._stream_delays: dict = {}  # cuda device -> gpu_delay.StreamDelay, calibrated once each

    @property
    def active(self) -> bool:
        return self.spec is not None

    def slow(self, work, kind: str, nbytes: int, group_size: int, recorder, token, tensors, on_done=None):
        """``work`` held back by the link (None when the link adds nothing: the caller's fast path).
        ``on_done()`` runs when it has crossed the link, as the recorder's ``completed``."""
        spec = self.spec
        if spec is None:
            return None
        seconds = spec.seconds(kind, nbytes, group_size)
        if seconds <= 0:
            return None

        def done() -> None:
            if on_done is not None:
                on_done()
            recorder.completed(kind, nbytes, token)

        try:
            real = work.get_future()
        except RuntimeError:  # send/recv: no future; the link is crossed in wait()
            return SlowMessageWork(work, recorder, done, self.wire, seconds)
        device = _cuda_device(tensors)
        held = torch.futures.Future(devices=[device]) if device is not None else torch.futures.Future()
        real.then(lambda finished: self._carry(finished, held, seconds, device))
        held.then(lambda _: done())
        return SlowWork(work, held, recorder)

    def hold_stream(self, kind: str, nbytes: int, group_size: int, tensors) -> None:
        """A collective ran inside the call, with no work to hold back (nccl's synchronous ones): the
        link's time is spent where it ran, in the GPU's current stream, or on the calling thread on a CPU.

        Such a collective is ordered by its stream, not by the wire: it is not queued behind the
        asynchronous collectives the wire is carrying."""
        spec = self.spec
        if spec is None:
            return
        seconds = spec.seconds(kind, nbytes, group_size)
        if seconds <= 0:
            return
        device = _cuda_device(tensors)
        if device is None:
            self.wire.cross(seconds)
            return
        self.stream_delay(device).delay(seconds)

    def stream_delay(self, device) -> StreamDelay:
        """This rank's way to hold ``device``'s stream back, calibrated once for the rank's life (the
        link and ``%lab slow`` share it)."""
        delay = self._stream_delays.get(device)
        if delay is None:
            delay = self._stream_delays[device] = StreamDelay(device)
        return delay

    def _carry(self, finished, held, seconds: float, device) -> None:
        """The real collective is done (on the thread that completed it): hand it to the wire."""
        try:
            value = finished.value()
        except Exception as error:  # noqa: BLE001 - it failed: fail now, there is nothing to carry
            held.set_exception(error)
            return
        event = None
        if device is not None:  # the callback's stream follows the collective; the wire's thread must too
            event = torch.cuda.Event()
            with torch.cuda.device(device):
                event.record()

        def finish() -> None:
            if event is not None:
                # On the wire's own thread, whose current device is GPU 0 until set: a CUDA call there
                # without the event's device would make a context on GPU 0 in every rank.
                with torch.cuda.device(device):
                    event.synchronize()
            held.set_result(value)

        self.wire.carry(seconds, finish)


def apply_link(context, spec) -> str:
    """Set this rank's link (None: off), on the world group and on every mesh the rank has built."""
    link = context.link
    link.spec = spec
    if spec is not None:
        for (_, _, instrumented), mesh in context.meshes.items():
            if not instrumented:  # instrumented meshes were given the link when they were built
                instrument_mesh(mesh, QuietRecorder(), link)
    return "off" if spec is None else spec.describe()
