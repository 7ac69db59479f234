"""Per-step measurements on a GPU rank, from CUDA events instead of CPU clocks.

A GPU runs kernels asynchronously: the CPU enqueues a step's work and moves on,
so CPU clocks see neither compute nor communication. ``CudaStepRecorder`` makes
the same rows as ``instruments.StepRecorder`` from CUDA events, read once the
GPU has passed them (a row lands a step or two after the CPU enqueued it; the
loop never waits for the GPU to measure it):

- ``seconds``: from an event recorded on the compute stream where the step
  begins to one where it ends;
- ``comm`` per kind: each collective from the event recorded on the issuing
  stream when it was issued (it cannot start earlier) to an event recorded, in
  its completion callback, on a stream that waits for it (torch runs that
  callback on a pool stream synchronised with the collective);
- ``exposed_comm``: the time the compute stream spent waiting for
  communication. Each place where it may wait is bracketed by two events on the
  compute stream, and nothing else runs on that stream between them: a
  ``Work.wait()`` (tensor-parallel collectives, pipeline sends and receives, a
  hand-written gradient all-reduce), FSDP's wait for a layer's all-gather before
  the layer runs (its pre-forward hook), and the end of backward, where DDP and
  FSDP wait for their last gradient reductions (from a callback queued first at
  the start of backward to the moment ``backward()`` returns). A bracket also
  holds work that follows the wait on the same stream (FSDP's copy-out of the
  gathered parameters, DDP's copy of reduced buckets into the gradients), so
  each is cut where the last collective it overlaps completed, and one that
  overlaps none (what it waited for was already done) counts nothing
  (``exposed_regions``). A synchronous nccl collective runs on the stream that
  issued it (``ran_in_stream``): on the compute stream, its whole run is exposed.
  The union of these intervals inside the step is the exposed time;
- ``compute``: the rest, so compute and exposed communication add up to the step.

What this cannot see: waits hidden inside other code (FSDP's backward
all-gathers are prefetched and usually overlap; if they do not, the wait counts
as compute), and CPU stalls that starve the GPU (they count as compute too,
since the compute stream is idle waiting for work, not for a peer).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from labkit.rank.instruments.recorder import ROW_CAPACITY, TIMELINE_STEPS, newest_rows
from labkit.torch_support.torch_internals import at_end_of_backward
from labkit.wire.schema import StepRow, TimelineStep


def union_length(intervals, begin: float, end: float) -> float:
    """Total length of the union of ``intervals`` (pairs of seconds), clipped to [begin, end]."""
    total, reach = 0.0, begin
    for low, high in sorted((max(low, begin), min(high, end)) for low, high in intervals):
        if high <= reach:
            continue
        total += high - max(low, reach)
        reach = high
    return total


def exposed_regions(regions, collectives) -> list[tuple[float, float]]:
    """The parts of wait brackets ``regions`` [(a, b)] spent waiting for a collective [(kind, bytes, issued,
    completed)]: each bracket up to the last completion of a collective that overlaps it; none if none does."""
    kept = []
    for low, high in regions:
        last = max((completed for _, _, issued, completed in collectives if issued <= high and completed >= low),
                   default=None)
        if last is not None:
            kept.append((low, min(high, last)))
    return kept


def assemble_row(step: dict, times: dict) -> tuple[StepRow, TimelineStep]:
    """A step row and its timeline entry from event times (seconds on one GPU clock).

    ``times`` maps: start, end, regions [(a, b)], collectives [(kind, nbytes,
    issued, completed)], origin_wall (the wall time the clock's zero stands for).
    """
    start, end, wall = times["start"], times["end"], times["origin_wall"]
    regions = exposed_regions(times["regions"], times["collectives"])
    seconds = max(0.0, end - start)
    exposed = min(seconds, union_length(regions, start, end))
    comm: dict[str, float] = {}
    sent: dict[str, int] = {}
    for kind, nbytes, issued, completed in times["collectives"]:
        comm[kind] = comm.get(kind, 0.0) + max(0.0, completed - issued)
        sent[kind] = sent.get(kind, 0) + nbytes
    row: StepRow = {
        "step": step["step"],
        "rank": step["rank"],
        "start": wall + start,
        "seconds": seconds,
        "compute": seconds - exposed,
        "exposed_comm": exposed,
        "comm": comm,
        "bytes": sent,
        "samples": step["samples"],
        "tokens": step["tokens"],
        "loss": step["loss"],
        "delay": step["delay"],
    }
    spans, cursor = [], start
    for low, high in sorted((max(low, start), min(high, end)) for low, high in regions):
        if high <= cursor:
            continue
        low = max(low, cursor)
        if low > cursor:
            spans.append((wall + cursor, wall + low, 1.0))
        spans.append((wall + low, wall + high, 0.0))
        cursor = high
    if end > cursor:
        spans.append((wall + cursor, wall + end, 1.0))
    entry: TimelineStep = {
        "step": step["step"],
        "rank": step["rank"],
        "start": wall + start,
        "end": wall + end,
        "busy": spans,
        "collectives": [(kind, nbytes, wall + issued, wall + completed)
                        for kind, nbytes, issued, completed in times["collectives"]],
    }
    return row, entry


@contextlib.contextmanager
def calling_at_backward_end(loss: torch.Tensor, callback):
    """Within this, ``callback`` runs once ``loss``'s backward has run all its kernels.

    It is queued from a hook on the loss, the first thing backward reaches, so
    it runs before the final callbacks DDP and FSDP queue later (where they wait
    for their last gradient reductions).
    """
    def at_backward_start(grad):
        at_end_of_backward(callback)
        return grad

    handle = loss.register_hook(at_backward_start)
    try:
        yield
    finally:
        handle.remove()


def _event() -> torch.cuda.Event:
    """A timing event recorded now on the calling thread's current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class LossSlots:
    """Each step's loss copied, without waiting, into a pinned host scalar; read once its step has passed.

    ``float()`` of a GPU loss would wait for the compute stream, which by the time a
    row is made already holds the next step: every row would drain the GPU. Slots are
    reused once read, so only as many exist as steps wait to be read."""

    def __init__(self, allocate=None, device_type: str = "cuda") -> None:
        """``allocate``: makes one host scalar (pinned by default); ``device_type``: whose losses are copied."""
        self._allocate = allocate or (lambda: torch.empty((), dtype=torch.float32, pin_memory=True))
        self._device_type = device_type
        self._free: list = []

    def copy(self, loss):
        """What stands for ``loss`` until its step's end event has passed (a GPU tensor: a pinned slot)."""
        if not isinstance(loss, torch.Tensor) or loss.device.type != self._device_type:
            return loss
        slot = self._free.pop() if self._free else self._allocate()
        slot.copy_(loss.detach().float(), non_blocking=True)
        return _Slot(slot)

    def read(self, held) -> float | None:
        """The loss as a number (its slot goes back for reuse)."""
        if held is None:
            return None
        if isinstance(held, _Slot):
            value = float(held.tensor)
            self._free.append(held.tensor)
            return value
        return float(held)


class _Slot:
    """A loss copied into ``tensor`` (host memory) by a copy that lands with its step's end event."""

    __slots__ = ("tensor",)

    def __init__(self, tensor) -> None:
        self.tensor = tensor


class CudaStepRecorder:
    """Rows of per-step measurements on a CUDA rank; the interface of ``StepRecorder``."""

    watches_waits = True

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.rows: deque = deque(maxlen=ROW_CAPACITY)
        self.timeline: deque = deque(maxlen=TIMELINE_STEPS)
        self.paused = False
        self._compute_stream: torch.cuda.Stream | None = None
        self._origin: tuple[torch.cuda.Event, float] | None = None  # every time of the run counts from it
        self._step: dict | None = None
        self._pending: deque = deque()
        self._loss_slots = LossSlots()

    @contextlib.contextmanager
    def lab_traffic(self):
        """Within: collectives are the lab's own, not the loop's (none is issued into a step's events)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    # -- fed by TimedGroup --------------------------------------------------

    def issued(self, device_type: str, kind: str | None = None, nbytes: int = 0):
        if device_type != "cuda" or self.paused or self._step is None:
            return None
        return _event()

    def completed(self, kind: str, nbytes: int, token) -> None:
        step = self._step
        if token is None or step is None:
            return
        step["collectives"].append((kind, nbytes, token, _event()))

    def ran_in_stream(self, kind: str, nbytes: int, token) -> None:
        """A collective ran on the issuing stream (nccl's synchronous ones): done where it ends there, and
        when that stream is the compute stream, all of it was a wait."""
        step = self._step
        if token is None or step is None:
            return
        done = _event()
        step["collectives"].append((kind, nbytes, token, done))
        if torch.cuda.current_stream(self.device) == self._compute_stream:
            step["regions"].append((token, done))

    @contextlib.contextmanager
    def waiting(self):
        """Bracket a wait of the compute stream for a collective with two events."""
        step = self._step
        if step is None or torch.cuda.current_stream(self.device) != self._compute_stream:
            yield
            return
        before = _event()
        try:
            yield
        finally:
            step["regions"].append((before, _event()))

    # -- fed by the model ----------------------------------------------------

    @contextlib.contextmanager
    def backward_watch(self, loss: torch.Tensor):
        """Bracket the end of backward, where DDP and FSDP wait for their last reductions."""
        step = self._step
        if step is None or not loss.requires_grad:
            yield
            return
        marks: dict[str, torch.cuda.Event] = {}
        with calling_at_backward_end(loss, lambda: marks.setdefault("end", _event())):
            yield
        if "end" in marks:
            step["regions"].append((marks["end"], _event()))

    def watch_module_waits(self, module: torch.nn.Module) -> None:
        """Bracket FSDP's pre-forward hooks, where a layer waits for its all-gathered parameters."""
        from torch.distributed.fsdp import FSDPModule

        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                opened = []
                submodule.register_forward_pre_hook(lambda *_: opened.append(self._open()), prepend=True)
                submodule.register_forward_pre_hook(lambda *_: self._close(opened.pop() if opened else None))

    def _open(self):
        if self._step is None or torch.cuda.current_stream(self.device) != self._compute_stream:
            return None
        return _event()

    def _close(self, before) -> None:
        if before is not None and self._step is not None:
            self._step["regions"].append((before, _event()))

    # -- fed by the training loop -----------------------------------------

    def clear(self) -> None:
        self.rows.clear()
        self.timeline.clear()
        self._pending.clear()
        self._step = None
        self._origin = None

    def begin_step(self, step: int) -> None:
        self._compute_stream = torch.cuda.current_stream(self.device)
        start = _event()
        if self._origin is None:
            self._origin = (start, time.time())
        self._step = {"step": step, "rank": self.rank, "start": start, "regions": [], "collectives": []}

    def end_step(self, samples: float, tokens: float | None, loss, delay: float = 0.0) -> None:
        step, self._step = self._step, None
        assert step is not None  # begin_step came first
        loss = self._loss_slots.copy(loss)  # before the end event: once that has passed, the copy has landed
        step.update(end=_event(), samples=samples, tokens=tokens, loss=loss, delay=delay)
        self._pending.append(step)
        self._resolve(wait=False)

    def finish(self) -> None:
        """Read every step still pending (waits for the GPU to pass them)."""
        self._resolve(wait=True)

    def _resolve(self, wait: bool) -> None:
        while self._pending:
            assert self._origin is not None  # the first step since the last clear set it, before any was pending
            origin, wall = self._origin
            step = self._pending[0]
            events = [step["start"], step["end"], *(e for pair in step["regions"] for e in pair),
                      *(e for *_, issued, done in step["collectives"] for e in (issued, done))]
            if wait:
                for event in events:
                    event.synchronize()
            elif not all(event.query() for event in events):
                return
            self._pending.popleft()

            def at(event) -> float:
                return origin.elapsed_time(event) / 1000.0

            times = {
                "start": at(step["start"]),
                "end": at(step["end"]),
                "regions": [(at(a), at(b)) for a, b in step["regions"]],
                "collectives": [(kind, nbytes, at(issued), at(done))
                                for kind, nbytes, issued, done in step["collectives"]],
                "origin_wall": wall,
            }
            step["loss"] = self._loss_slots.read(step["loss"])
            row, entry = assemble_row(step, times)
            self.rows.append(row)
            self.timeline.append(entry)

    def newest(self, count: int) -> list[dict]:
        return newest_rows(self.rows, count)
