"""DiLoCo across sites, the hub's side: rounds, shares, the average and the outer Nesterov step.

``OuterHub`` serves the sync streams of one run on the line hub's loop (a loopback listener the hub
lets sites reach as the ``sync`` target). Each site trains one share per round (``strategies.diloco_sites``
says what a share is); the hub keeps the queue of shares, every share trained exactly once:

- **a round opens** with the sites whose holders all wait (the first round: all expected sites, or
  those there after ``start_timeout``); each takes the next share of the queue;
- **it closes** when every site of the round sent its pseudo-gradient (or was declared lost: the
  notebook says so the moment it sees the site's ranks fail), or ``round_timeout`` after it opened
  once ``quorum`` sites have sent; a site that has not is left out, its share goes back to the head
  of the queue, and when it comes it gets the global weights whole and waits for the next round;
- **the outer step**, per holder: the mean of the pseudo-gradients received (in share order), SGD
  with Nesterov momentum (torch's arithmetic, ``diloco_outer.outer_update``), the update rounded to
  the wire (bf16 by default) with what the rounding left carried into the next round, and
  subtracted from the hub's global copy exactly as every site subtracts it from its own.

The notebook reads ``progress()`` and ``rounds`` (a copy, from any thread); numpy only, no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy

from labkit.wire import sync_messages


def round_to_bf16(values: numpy.ndarray) -> numpy.ndarray:
    """float32 -> the bits of bfloat16, rounded to nearest even (as torch rounds); NaN stays NaN."""
    bits = values.astype(numpy.float32).view(numpy.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(numpy.uint16)
    nan = numpy.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def bf16_to_float(bits: numpy.ndarray) -> numpy.ndarray:
    return (bits.astype(numpy.uint32) << 16).view(numpy.float32)


def from_wire(payload: bytes, wire: str) -> numpy.ndarray:
    if wire == "bf16":
        return bf16_to_float(numpy.frombuffer(payload, dtype=numpy.uint16))
    return numpy.frombuffer(payload, dtype=numpy.float32).copy()


@dataclass
class HolderState:
    """The hub's outer state for one holder's part of the model (the whole model under ddp)."""

    weights: numpy.ndarray
    momentum: numpy.ndarray
    residual: numpy.ndarray

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.weights.tobytes()).hexdigest()[:32]


@dataclass
class RoundRecord:
    round: int
    shares: dict[str, tuple[int, int]]  # site -> (block, slice) it trained
    used: list[str]  # the sites whose pseudo-gradients made the step
    left_out: list[str]
    opened: float
    seconds: float
    bytes_in: int  # pseudo-gradients received
    bytes_out: int  # updates and weights sent (this round's updates; resyncs counted when sent)


@dataclass
class _Site:
    holders: int = 0
    waiting: dict[int, asyncio.Future] = field(default_factory=dict)  # holder -> its answer, when a round opens
    sent: dict[int, numpy.ndarray] = field(default_factory=dict)  # this round's pseudo-gradients, by holder
    share: tuple[int, int] | None = None
    lost: bool = False
    stale: bool = False  # it waits without the last update: it gets the weights whole


class OuterHub:
    def __init__(self, run: str, key: str, expected: list[str], replicas: int, blocks: int, lr: float,
                 momentum: float, wire: str, quorum: int, round_timeout: float, start_timeout: float) -> None:
        self.run, self.key, self.expected = run, key, list(expected)
        self.replicas, self.lr, self.momentum, self.wire = replicas, lr, momentum, wire
        self.quorum, self.round_timeout, self.start_timeout = quorum, round_timeout, start_timeout
        self.queue: deque[tuple[int, int]] = deque((block, part) for block in range(blocks) for part in range(replicas))
        self.state: dict[int, HolderState] = {}
        self.layouts: dict[int, list[tuple[str, tuple[int, ...]]]] = {}  # holder -> (name, shape) of its vector
        self.sites: dict[str, _Site] = {}
        self.round = -1  # none open yet
        self.opened_at: float | None = None
        self.participants: list[str] = []
        self.rounds: list[RoundRecord] = []
        self.finished = False
        self.began = time.monotonic()
        self.bytes_in = self.bytes_out = 0
        self._round_in = self._round_out = 0
        self._guard = threading.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None
        self.port = 0

    # -- serving --------------------------------------------------------------------

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self.port

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for site in self.sites.values():
            for future in site.waiting.values():
                if not future.done():
                    future.cancel()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader, writer) -> None:
        parts: dict[int, bytes] = {}
        site_name, holder = None, 0
        try:
            while True:
                header, payload = await sync_messages.receive_async(reader)
                if header["op"] == "part":
                    parts[header["offset"]] = payload
                    continue
                if header.get("run") != self.run or not hmac.compare_digest(str(header.get("key")), self.key):
                    break  # not this run's: nothing is answered
                site_name, holder = str(header["site"]), int(header["holder"])
                data, parts = b"".join(parts[offset] for offset in sorted(parts)), {}
                answer, vector = await self._answer(site_name, holder, header, data)
                writer.write(sync_messages.encode(answer))
                if vector is not None:
                    for offset, count, piece in sync_messages.fragments(vector, 2 if answer.get("bf16") else 4):
                        writer.write(sync_messages.encode({"op": "part", "offset": offset, "count": count}, bytes(piece)))
                        self._count_out(len(piece))
                        await writer.drain()
                    writer.write(sync_messages.encode({"op": "end"}))
                await writer.drain()
        except (sync_messages.SyncWireError, ConnectionError, asyncio.CancelledError, OSError):
            pass
        finally:
            if site_name is not None and site_name in self.sites:
                self.sites[site_name].waiting.pop(holder, None)
            with contextlib.suppress(Exception):
                writer.close()

    def _count_out(self, count: int) -> None:
        self.bytes_out += count
        self._round_out += count

    async def _answer(self, name: str, holder: int, header: dict, data: bytes):
        site = self.sites.setdefault(name, _Site())
        operation = header["op"]
        if operation == "hello":
            site.lost, site.holders = False, int(header["holders"])
            self.layouts.setdefault(holder, [(str(n), tuple(int(d) for d in shape)) for n, shape in header["layout"]])
            if holder not in self.state:
                return {"op": "upload"}, None
            return await self._wait_for_share(name, holder, header.get("digest"))
        if operation == "initial":
            weights = numpy.frombuffer(data, dtype=numpy.float32).copy()
            self.state.setdefault(holder, HolderState(weights, numpy.zeros_like(weights), numpy.zeros_like(weights)))
            return await self._wait_for_share(name, holder, self.state[holder].digest)
        if operation == "pseudo":
            self.bytes_in += len(data)
            self._round_in += len(data)
            if int(header["round"]) == self.round and name in self.participants and not site.lost:
                site.sent[holder] = from_wire(data, self.wire)
                return await self._wait_for_share(name, holder, None, update=True)
            return await self._wait_for_share(name, holder, "late")  # its round closed without it
        return {"op": "error", "message": f"unknown request {operation!r}"}, None

    async def _wait_for_share(self, name: str, holder: int, digest: str | None, update: bool = False):
        """Park this holder until the next round opens; then its share, and the update or the weights."""
        future = asyncio.get_running_loop().create_future()
        site = self.sites[name]
        site.waiting[holder] = future
        if self.finished:  # every share is trained: the final weights, and no share
            self._release(site, None, None)
        # Only now, with this holder waiting, may the round close (its answer is the next round's share).
        self._maybe_close() if update else self._maybe_open()
        share, update_vector = await future
        state = self.state[holder]
        answer = {"op": "update" if update and update_vector is not None else "resync", "round": self.round,
                  "share": share}
        if answer["op"] == "update":
            return {**answer, "bf16": self.wire == "bf16"}, update_vector
        need = digest != state.digest
        return {**answer, "weights": need}, state.weights.tobytes() if need else None

    # -- rounds -----------------------------------------------------------------------

    def _ready(self, name: str) -> bool:
        site = self.sites.get(name)
        return site is not None and not site.lost and site.holders > 0 and len(site.waiting) == site.holders

    def _maybe_open(self) -> None:
        if self.participants or self.finished:
            return  # a round is open: who waits now takes part in the next one
        ready = sorted(name for name in self.sites if self._ready(name))
        expected = [name for name in self.expected if not self.sites.get(name, _Site()).lost]
        if self.round < 0 and len(ready) < len(expected) and time.monotonic() - self.began < self.start_timeout:
            return  # the first round waits for every site the run was started on
        if ready:
            self._open(ready, {}, frozenset())

    def _open(self, candidates: list[str], updates: dict[int, bytes], delivered: set[str] | frozenset = frozenset()):
        """The next round: each candidate takes the next share. One left without a share waits (a share of a
        site lost in this round may come back to the queue) until the run is finished."""
        self.round += 1
        self.opened_at = time.monotonic()
        self._round_in = self._round_out = 0
        for name in candidates:
            site = self.sites[name]
            site.share = self.queue.popleft() if self.queue else None
            if site.share is not None:
                self.participants.append(name)
                self._release(site, site.share, updates if name in delivered else None)
        if not self.participants and not self.queue:
            self.finished = True
            for name in sorted(self.sites):  # every site that waits gets the final weights, and no share
                self._release(self.sites[name], None, updates if name in delivered else None)

    def _release(self, site: _Site, share, updates: dict[int, bytes] | None) -> None:
        if not site.waiting:
            return
        if site.stale:  # it missed updates while it waited: the weights whole, not one update
            updates, site.stale = None, False
        for holder, future in list(site.waiting.items()):
            if not future.done():
                future.set_result((None if share is None else list(share),
                                   None if updates is None else updates.get(holder)))
        site.waiting.clear()

    def _maybe_close(self, now: float | None = None) -> None:
        if not self.participants:
            return
        now = time.monotonic() if now is None else now
        present = [name for name in self.participants if not self.sites[name].lost]
        delivered = [name for name in present if len(self.sites[name].sent) == self.sites[name].holders]
        overdue = self.opened_at is not None and now - self.opened_at > self.round_timeout
        if len(delivered) < len(present) and not (overdue and len(delivered) >= min(self.quorum, len(present))):
            return
        self._close(delivered)

    def _close(self, delivered: list[str]) -> None:
        shares = {name: self.sites[name].share for name in self.participants}
        left_out = [name for name in self.participants if name not in delivered]
        for name in sorted(left_out, key=lambda n: shares[n] or (0, 0), reverse=True):
            share = shares[name]
            if share is not None:
                self.queue.appendleft(share)  # trained by the next site free, before any new share
        order = sorted(delivered, key=lambda n: shares[n] or (0, 0))
        updates = self._outer_step(order) if delivered else {}
        sent = sum(len(update) for update in updates.values()) * len(delivered)
        record = RoundRecord(self.round, {n: s for n, s in shares.items() if s is not None}, sorted(delivered),
                             sorted(left_out), self.opened_at or 0.0, time.monotonic() - (self.opened_at or 0.0),
                             self._round_in, sent)
        with self._guard:
            self.rounds.append(record)
        self.participants = []
        for name in delivered:
            self.sites[name].sent.clear()
        # Who goes on: the sites that sent (with their update), then those that waited to come in (rejoined
        # or late: they get the weights whole). A site that sent but gets no share keeps waiting.
        waiting = [name for name in sorted(self.sites) if name not in delivered and self._ready(name)]
        self._open(order + waiting, updates, set(delivered))
        for name in order:  # no share for it this round: it needs the weights whole when it goes on
            if self.sites[name].waiting and name not in self.participants and not self.finished:
                self.sites[name].stale = True

    def _outer_step(self, delivered: list[str]) -> dict[int, bytes]:
        """The average of what ``delivered`` sent, the outer step on every holder; the update each site applies."""
        updates = {}
        for holder, state in self.state.items():
            total = numpy.zeros_like(state.weights)
            for name in delivered:
                total += self.sites[name].sent[holder]
            mean = total / numpy.float32(len(delivered))
            state.momentum *= numpy.float32(self.momentum)
            state.momentum += mean
            step = (mean + numpy.float32(self.momentum) * state.momentum) * numpy.float32(self.lr) + state.residual
            if self.wire == "bf16":
                bits = round_to_bf16(step)
                sent = bf16_to_float(bits)
                updates[holder] = bits.tobytes()
            else:
                sent = step
                updates[holder] = step.astype(numpy.float32).tobytes()
            state.residual = (step - sent).astype(numpy.float32)
            state.weights -= sent
        return updates

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._maybe_open()
            self._maybe_close()

    # -- from the notebook's thread ------------------------------------------------------

    def site_lost(self, name: str) -> None:
        """(On the hub's loop.) ``name``'s ranks failed: it is left out of the open round at once."""
        site = self.sites.setdefault(name, _Site())
        site.lost = True
        site.sent.clear()
        for future in site.waiting.values():
            if not future.done():
                future.cancel()
        site.waiting.clear()
        self._maybe_close()
        self._maybe_open()

    def progress(self) -> dict:
        with self._guard:
            return {"round": self.round, "rounds": list(self.rounds), "queued": len(self.queue),
                    "participants": list(self.participants), "finished": self.finished,
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def global_weights(self) -> dict[int, numpy.ndarray]:
        return {holder: state.weights.copy() for holder, state in self.state.items()}
