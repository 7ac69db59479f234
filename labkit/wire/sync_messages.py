"""The messages of DiLoCo's outer sync across sites: a JSON header and raw bytes, over one stream.

A message is 12 bytes (the header's length, the payload's length), the header (JSON) and the payload.
Tensors travel as their raw bytes in fragments of at most ``FRAGMENT_BYTES`` each, one message per
fragment, so no message is ever large and the hub adds a fragment to its sum as it comes. Nothing
here is pickled: a header is data, a payload is numbers.

``send``/``receive`` are the blocking ends a rank uses on its socket; the hub reads with
``receive_async`` on an asyncio stream.
"""

from __future__ import annotations

import json
import socket
import struct

LENGTHS = struct.Struct(">IQ")
FRAGMENT_BYTES = 4 * 1024 * 1024
MAX_HEADER = 64 * 1024


class SyncWireError(RuntimeError):
    """The other end closed the stream, or sent what is not a sync message."""


def encode(header: dict, payload: bytes = b"") -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return LENGTHS.pack(len(text), len(payload)) + text + payload


def _decode_header(lengths: bytes) -> tuple[int, int]:
    size, payload = LENGTHS.unpack(lengths)
    if size > MAX_HEADER or payload > 2 * FRAGMENT_BYTES:
        raise SyncWireError(f"a sync message of {size} + {payload} bytes is not one this lab sends")
    return size, payload


def send(connection: socket.socket, header: dict, payload: bytes = b"") -> None:
    connection.sendall(encode(header, payload))


def _exactly(connection: socket.socket, count: int) -> bytes:
    pieces, left = [], count
    while left:
        piece = connection.recv(min(left, 1 << 20))
        if not piece:
            raise SyncWireError("the hub closed the outer sync's stream")
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def _header(text: bytes) -> dict:
    try:
        header = json.loads(text)
    except ValueError:
        raise SyncWireError("a sync message's header is not JSON") from None
    if not isinstance(header, dict):
        raise SyncWireError("a sync message's header is not a JSON object")
    return header


def receive(connection: socket.socket) -> tuple[dict, bytes]:
    size, payload = _decode_header(_exactly(connection, LENGTHS.size))
    return _header(_exactly(connection, size)), _exactly(connection, payload)


async def receive_async(reader) -> tuple[dict, bytes]:
    import asyncio

    try:
        size, payload = _decode_header(await reader.readexactly(LENGTHS.size))
        header = _header(await reader.readexactly(size))
        return header, await reader.readexactly(payload)
    except asyncio.IncompleteReadError:
        raise SyncWireError("a site closed the outer sync's stream") from None


def fragments(data: bytes | memoryview, item_bytes: int):
    """(first element, element count, bytes) of each fragment of ``data``, cut at element boundaries."""
    view = memoryview(data).cast("B")
    step = FRAGMENT_BYTES - FRAGMENT_BYTES % item_bytes
    for start in range(0, len(view), step):
        piece = view[start:start + step]
        yield start // item_bytes, len(piece) // item_bytes, piece
