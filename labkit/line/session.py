"""One line's session: TCP streams and control messages multiplexed over whichever websocket is attached.

Both ends hold a ``LineSession``. The joining machine's agent opens streams (``open_stream``: one per
TCP connection its engines and ranks make to a local end of the line); the hub answers each OPEN by
connecting to the target it names (``on_open``) and pumps bytes both ways. The hub opens streams the
other way only to a port on the site's loopback that the site's own ranks listen on (their rendezvous
store, which the notebook writes stop requests into and reads the ranks' whereabouts from). A session outlives its
websocket: when one drops, frames wait in the outbox (``frames.Outbox``) and the streams stay open;
``attach`` of the next websocket sends again what the other end did not receive, so a short drop
loses nothing. Each attachment sends a keep-alive every ``KEEP_SECONDS`` and an acknowledgement at
least as often, and gives a websocket up (aborts it) after ``DEAD_SECONDS`` without a frame: a cut
link that sends no reset is noticed in seconds, not at TCP's timeout.

Runs on one asyncio loop (the hub's thread, or the agent's main loop); nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

from labkit.line import frames
from labkit.line.frames import CLOSE, CONTROL, DATA, OPEN, Frame

KEEP_SECONDS = 0.5
DEAD_SECONDS = 4.0
ACK_BYTES = 256 * 1024  # acknowledge at least every this many bytes received (and every keep-alive)
DRAIN_SECONDS = 60.0  # a local socket that takes no bytes for this long is closed, not waited on forever
READ_BYTES = frames.MAX_PAYLOAD

log = logging.getLogger("labkit.line")

Opener = Callable[["LineSession", str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]]


class Stream:
    """One TCP connection carried by the line: its local socket and the pump that reads it."""

    def __init__(self, session: LineSession, number: int, target: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.session, self.number, self.target = session, number, target
        self.reader, self.writer = reader, writer
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        """Local bytes into the line, until the local end closes (then the far end is closed too)."""
        try:
            while True:
                data = await self.reader.read(READ_BYTES)
                if not data:
                    break
                await self.session.send(DATA, self.number, data)
                self.session.bytes_out[self.target] += len(data)
        except (ConnectionError, OSError, LineClosed):
            pass
        finally:
            if self.session.streams.pop(self.number, None) is self:
                with contextlib.suppress(LineClosed):
                    await self.session.send(CLOSE, self.number, b"")
            self._close_local()

    async def deliver(self, data: bytes) -> None:
        self.session.bytes_in[self.target] += len(data)
        if self.writer.is_closing():  # the local end went: its close is on its way to the far end
            return
        self.writer.write(data)
        try:
            await asyncio.wait_for(self.writer.drain(), DRAIN_SECONDS)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            self.close()

    def close(self) -> None:
        """The far end closed (or the session ends): close the local socket and stop the pump."""
        self.session.streams.pop(self.number, None)
        self.pump.cancel()
        self._close_local()

    def _close_local(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class LineClosed(RuntimeError):
    """The session ended (the lab stopped, the site left, or the hub gave the session up)."""


class LineSession:
    """Frames in order both ways across reconnects; streams by number; control messages to a handler."""

    def __init__(self, label: str, on_open: Opener | None = None,
                 on_control: Callable[[dict], Awaitable[None]] | None = None, limit: int = frames.DEFAULT_LIMIT,
                 first_stream: int = 1):
        self.label = label
        self.on_open = on_open  # the hub: connect to the target an OPEN names
        self.on_control = on_control
        self.outbox = frames.Outbox(limit)
        self.inbox = frames.Inbox()
        self.streams: dict[int, Stream] = {}
        self.websocket = None
        self.detached_at: float | None = time.monotonic()  # None while a websocket is attached
        self.last_heard = time.monotonic()
        self.closed = False
        self.bytes_out: Counter[str] = Counter()  # stream payload bytes by target, both directions
        self.bytes_in: Counter[str] = Counter()
        # Both ends open streams: the agent numbers its own 1, 3, 5, ..., the hub 2, 4, 6, ...
        self._next_stream = first_stream
        self._lock = asyncio.Lock()  # frames leave in the order they were numbered
        self._room = asyncio.Condition()

    # -- sending -------------------------------------------------------------------

    async def send(self, kind: int, stream: int, payload: bytes) -> None:
        """Number a frame and send it now, or when the next websocket is attached. Waits while the
        outbox is full (the far end has not acknowledged ``limit`` bytes)."""
        async with self._room:
            await self._room.wait_for(lambda: self.closed or not self.outbox.full)
        if self.closed:
            raise LineClosed(f"the line {self.label} is closed")
        async with self._lock:
            encoded = self.outbox.stamp(kind, stream, payload)
            await self._put(encoded)

    async def send_control(self, message: dict) -> None:
        await self.send(*frames.control(message))

    async def _put(self, encoded: bytes) -> None:
        """Onto the attached websocket, if any (the caller holds the lock). A failed send is sent again
        after the next attach: the frame is still in the outbox."""
        websocket = self.websocket
        transport = getattr(websocket, "transport", None)
        if websocket is None or transport is None or transport.is_closing():
            return  # dropped: the frame waits in the outbox for the next websocket
        try:
            await websocket.send(encoded)
        except Exception:  # noqa: BLE001 - closed or broken: the watchdog or the reader detaches it
            pass

    async def open_stream(self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Stream:
        """A local connection that the far end is to connect to ``target``."""
        number = self._next_stream
        self._next_stream += 2
        await self.send(OPEN, number, target.encode())
        stream = Stream(self, number, target, reader, writer)
        self.streams[number] = stream
        return stream

    # -- a websocket attached --------------------------------------------------------

    async def attach(self, websocket, peer_received: int) -> None:
        """Use ``websocket`` until it closes: first send again what the far end has not received."""
        async with self._lock:
            for encoded in self.outbox.after(peer_received):
                await websocket.send(encoded)
            previous, self.websocket = self.websocket, websocket
            self.detached_at = None
        if previous is not None and previous is not websocket:
            abort(previous)
        await self._notify_room()
        self.last_heard = time.monotonic()
        keeper = asyncio.get_running_loop().create_task(self._keep(websocket))
        try:
            async for message in websocket:
                self.last_heard = time.monotonic()
                await self._receive(frames.decode(message))
        except frames.LineProtocolError:
            log.warning("line %s: protocol error, the session ends", self.label, exc_info=True)
            await self.close()
        except Exception:  # noqa: BLE001 - the connection broke: the session waits for the next one
            log.debug("line %s: websocket ended", self.label, exc_info=True)
        finally:
            keeper.cancel()
            if self.websocket is websocket:
                self.websocket = None
                self.detached_at = time.monotonic()
            abort(websocket)

    async def _receive(self, frame: Frame) -> None:
        if frame.kind == frames.ACK:
            self.outbox.acknowledged(frames.acked_number(frame))
            await self._notify_room()
            return
        if frame.kind == frames.KEEP or not self.inbox.accept(frame):
            return
        if frame.kind == DATA:
            stream = self.streams.get(frame.stream)
            if stream is not None:
                await stream.deliver(frame.payload)
        elif frame.kind == CLOSE:
            stream = self.streams.get(frame.stream)
            if stream is not None:
                stream.close()
        elif frame.kind == OPEN:
            await self._opened(frame.stream, frame.payload.decode())
        elif frame.kind == CONTROL and self.on_control is not None:
            await self.on_control(frame.json())
        if self.inbox.unacked_bytes >= ACK_BYTES:
            await self._ack()

    async def _opened(self, number: int, target: str) -> None:
        connected = await self.on_open(self, target) if self.on_open is not None else None
        if connected is None:
            await self.send(CLOSE, number, b"")  # refused: the far end closes its local socket
            return
        self.streams[number] = Stream(self, number, target, *connected)

    async def _ack(self) -> None:
        self.inbox.unacked_bytes = 0
        async with self._lock:
            await self._put(frames.ack(self.inbox.received))

    async def _keep(self, websocket) -> None:
        """Keep-alives and acknowledgements while attached; give the websocket up when the far end is silent."""
        while True:
            await asyncio.sleep(KEEP_SECONDS)
            if time.monotonic() - self.last_heard > DEAD_SECONDS:
                log.info("line %s: nothing heard for %.1f s, the websocket is given up", self.label, DEAD_SECONDS)
                abort(websocket)
                return
            async with self._lock:
                await self._put(frames.KEEP_FRAME)
            await self._ack()

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    # -- the end ----------------------------------------------------------------------

    async def close(self) -> None:
        """End the session: every stream's local socket is closed, the websocket aborted, senders released."""
        if self.closed:
            return
        self.closed = True
        for stream in list(self.streams.values()):
            stream.close()
        if self.websocket is not None:
            abort(self.websocket)
            self.websocket = None
        await self._notify_room()


def abort(websocket) -> None:
    """Drop a websocket at once (its TCP connection aborted: no closing handshake over a dead link)."""
    transport = getattr(websocket, "transport", None)
    if transport is not None:
        transport.abort()
