"""The frames of a line, and the bookkeeping that lets a line survive a dropped connection.

Every websocket message after the handshake is one binary frame: a 13-byte header (kind, sequence
number, stream id) and a payload. Streams are TCP connections carried inside the line (an engine's
connection to the controller, a rank's to the outer sync); control frames carry small JSON messages
between the joining machine's agent and the hub.

Frames that matter (OPEN, DATA, CLOSE, CONTROL) are numbered 1, 2, 3, ... by their sender and kept in
its ``Outbox`` until the other end acknowledges them (ACK frames, unnumbered, like KEEP, the keep-alive).
When the websocket drops and a new one is opened, each end says the last number it received and the
other sends again what came after: nothing is lost or doubled, and the TCP connections inside the line
never notice a drop shorter than the hub keeps a line waiting. ``Inbox`` drops what arrives twice.
The outbox is bounded (``limit`` bytes not yet acknowledged): a sender waits beyond it, which slows
the local socket it reads from, so a slow or cut link holds memory to that bound.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from dataclasses import dataclass

HEADER = struct.Struct(">BQI")  # kind, sequence number (0: unnumbered), stream id
OPEN, DATA, CLOSE, CONTROL, ACK, KEEP = range(1, 7)
NUMBERED = frozenset({OPEN, DATA, CLOSE, CONTROL})
NAMES = {OPEN: "open", DATA: "data", CLOSE: "close", CONTROL: "control", ACK: "ack", KEEP: "keep"}
MAX_PAYLOAD = 256 * 1024  # a stream's bytes go in pieces of at most this: no message is ever large
DEFAULT_LIMIT = 32 * 1024 * 1024


class LineProtocolError(RuntimeError):
    """The other end sent what the protocol does not allow (a gap in the numbers, an unknown kind)."""


@dataclass(frozen=True)
class Frame:
    kind: int
    seq: int
    stream: int
    payload: bytes

    def encode(self) -> bytes:
        return HEADER.pack(self.kind, self.seq, self.stream) + self.payload

    def json(self) -> dict:
        return json.loads(self.payload)


def decode(message: bytes) -> Frame:
    if not isinstance(message, (bytes, bytearray, memoryview)) or len(message) < HEADER.size:
        raise LineProtocolError(f"a frame of {len(message)} bytes is shorter than its header")
    kind, seq, stream = HEADER.unpack_from(message)
    if kind not in NAMES:
        raise LineProtocolError(f"unknown frame kind {kind}")
    if (kind in NUMBERED) != (seq > 0):
        raise LineProtocolError(f"a {NAMES[kind]} frame numbered {seq}")
    return Frame(kind, seq, stream, bytes(message[HEADER.size:]))


def control(message: dict) -> tuple[int, int, bytes]:
    """(kind, stream, payload) of a control message."""
    return CONTROL, 0, json.dumps(message, separators=(",", ":")).encode()


def ack(seq: int) -> bytes:
    return Frame(ACK, 0, 0, struct.pack(">Q", seq)).encode()


def acked_number(frame: Frame) -> int:
    return struct.unpack(">Q", frame.payload)[0]


KEEP_FRAME = Frame(KEEP, 0, 0, b"").encode()


class Outbox:
    """Numbered frames sent and not yet acknowledged, to send again after a reconnect."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self.next_seq = 1
        self.unacked: deque[tuple[int, bytes]] = deque()
        self.bytes = 0

    @property
    def full(self) -> bool:
        return self.bytes >= self.limit

    def stamp(self, kind: int, stream: int, payload: bytes) -> bytes:
        """The frame's bytes with the next number, kept until acknowledged."""
        if kind not in NUMBERED:
            raise ValueError(f"{NAMES.get(kind, kind)} frames are not numbered")
        encoded = Frame(kind, self.next_seq, stream, payload).encode()
        self.unacked.append((self.next_seq, encoded))
        self.bytes += len(encoded)
        self.next_seq += 1
        return encoded

    def acknowledged(self, seq: int) -> None:
        """The other end has every frame up to ``seq``: forget them."""
        if seq >= self.next_seq:
            raise LineProtocolError(f"acknowledged frame {seq}, but only {self.next_seq - 1} were sent")
        while self.unacked and self.unacked[0][0] <= seq:
            self.bytes -= len(self.unacked.popleft()[1])

    def after(self, seq: int) -> list[bytes]:
        """What to send again to an end that received up to ``seq``."""
        self.acknowledged(seq)
        return [encoded for number, encoded in self.unacked if number > seq]


class Inbox:
    """The last number received in order; a frame seen before is dropped, a gap is an error."""

    def __init__(self) -> None:
        self.received = 0
        self.unacked_bytes = 0  # received since the last ACK this end sent

    def accept(self, frame: Frame) -> bool:
        """Whether to act on ``frame`` (False: it came twice, around a reconnect)."""
        if frame.kind not in NUMBERED:
            return True
        if frame.seq <= self.received:
            return False
        if frame.seq != self.received + 1:
            raise LineProtocolError(f"frame {frame.seq} came after frame {self.received}: frames were lost")
        self.received = frame.seq
        self.unacked_bytes += len(frame.payload) + HEADER.size
        return True
