"""The outer sync's messages: encoding, the blocking and asyncio receivers, refusals, and fragments.

Messages travel over an in-process ``socket.socketpair()`` (blocking ends) or an ``asyncio.StreamReader``
fed the encoded bytes (the hub's end). A refusal of an oversized message must come from the 12 length
bytes alone: the tests give the receiver nothing more, so one that read on would time out instead.
``fragments`` is checked at the real ``FRAGMENT_BYTES`` and, for odd element sizes, at a small one.
"""

import asyncio
import json
import socket
import threading

import numpy
import pytest

from labkit.wire import sync_messages
from labkit.wire.sync_messages import (FRAGMENT_BYTES, LENGTHS, MAX_HEADER, SyncWireError, encode, fragments, receive,
                                       receive_async, send)

HEADER = {"op": "pseudo", "run": "r1", "site": "alpha", "holder": 0, "round": 3, "nested": {"a": [1, 2.5, None]}}


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    right.settimeout(5)  # a receiver that waits for bytes that never come fails the test instead of hanging it
    yield left, right
    left.close()
    right.close()


def feed(*chunks: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return reader


def receive_fed(*chunks: bytes, eof: bool = True):
    async def main():
        return await asyncio.wait_for(receive_async(feed(*chunks, eof=eof)), timeout=5)

    return asyncio.run(main())


def send_in_thread(connection: socket.socket, data: bytes) -> threading.Thread:
    thread = threading.Thread(target=connection.sendall, args=(data,), daemon=True)
    thread.start()
    return thread


# -- encode ----------------------------------------------------------------------------


def test_an_encoded_message_is_the_lengths_then_the_json_header_then_the_payload():
    encoded = encode({"op": "end", "n": 1}, b"\x01\x02\x03")
    size, payload = LENGTHS.unpack(encoded[:LENGTHS.size])
    assert LENGTHS.size == 12
    assert (size, payload) == (len(b'{"op":"end","n":1}'), 3)
    assert encoded[LENGTHS.size:LENGTHS.size + size] == b'{"op":"end","n":1}'
    assert encoded[LENGTHS.size + size:] == b"\x01\x02\x03"


def test_the_payload_defaults_to_empty():
    assert encode({"op": "end"}) == encode({"op": "end"}, b"")
    assert LENGTHS.unpack(encode({"op": "end"})[:LENGTHS.size])[1] == 0


def test_a_header_that_is_not_json_data_is_not_encoded():
    with pytest.raises(TypeError):
        encode({"op": "initial", "weights": b"raw bytes are a payload, not a header"})


# -- blocking send / receive -----------------------------------------------------------


def test_a_message_sent_comes_back_with_the_same_header_and_payload(pair):
    left, right = pair
    payload = bytes(range(256)) * 40
    send(left, HEADER, payload)
    assert receive(right) == (HEADER, payload)


def test_a_message_with_an_empty_payload_comes_back_with_an_empty_payload(pair):
    left, right = pair
    send(left, {"op": "hello"})
    header, payload = receive(right)
    assert header == {"op": "hello"} and payload == b""


def test_messages_sent_back_to_back_are_received_one_by_one_in_order(pair):
    left, right = pair
    for number in range(5):
        send(left, {"op": "part", "offset": number}, bytes([number]) * number)
    assert [receive(right) for _ in range(5)] == [({"op": "part", "offset": n}, bytes([n]) * n) for n in range(5)]


def test_a_message_that_arrives_one_byte_at_a_time_is_received_whole(pair):
    left, right = pair
    encoded = encode(HEADER, b"payload bytes")

    def trickle():
        for index in range(len(encoded)):
            left.sendall(encoded[index:index + 1])

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    assert receive(right) == (HEADER, b"payload bytes")
    thread.join(5)


def test_the_largest_payload_allowed_goes_through(pair):
    left, right = pair
    payload = bytes(range(251)) * (2 * FRAGMENT_BYTES // 251) + b"\x07" * (2 * FRAGMENT_BYTES % 251)
    assert len(payload) == 2 * FRAGMENT_BYTES
    thread = send_in_thread(left, encode({"op": "initial"}, payload))
    header, received = receive(right)
    thread.join(5)
    assert header == {"op": "initial"} and received == payload


def test_a_stream_closed_before_any_byte_raises_a_sync_wire_error(pair):
    left, right = pair
    left.close()
    with pytest.raises(SyncWireError, match="closed"):
        receive(right)


@pytest.mark.parametrize("cut", [5, LENGTHS.size, LENGTHS.size + 3, -1], ids=["lengths", "header", "mid-header",
                                                                             "payload"])
def test_a_stream_closed_mid_message_raises_a_sync_wire_error(pair, cut):
    left, right = pair
    left.sendall(encode(HEADER, b"0123456789")[:cut])
    left.shutdown(socket.SHUT_WR)
    with pytest.raises(SyncWireError, match="closed"):
        receive(right)


def test_a_header_over_max_header_is_refused_before_it_is_read(pair):
    left, right = pair
    left.sendall(LENGTHS.pack(MAX_HEADER + 1, 0))  # and nothing more: reading the header would time out
    with pytest.raises(SyncWireError, match=f"{MAX_HEADER + 1} \\+ 0 bytes"):
        receive(right)


def test_a_payload_over_two_fragments_is_refused_before_it_is_read(pair):
    left, right = pair
    left.sendall(LENGTHS.pack(2, 2 * FRAGMENT_BYTES + 1) + b"{}")
    with pytest.raises(SyncWireError, match=f"2 \\+ {2 * FRAGMENT_BYTES + 1} bytes"):
        receive(right)


def test_a_header_of_exactly_max_header_is_accepted(pair):
    left, right = pair
    header = {"pad": ""}
    header["pad"] = "x" * (MAX_HEADER - len(json.dumps(header, separators=(",", ":"))))
    encoded = encode(header)
    assert LENGTHS.unpack(encoded[:LENGTHS.size])[0] == MAX_HEADER
    thread = send_in_thread(left, encoded)
    assert receive(right) == (header, b"")
    thread.join(5)


# -- receive_async ---------------------------------------------------------------------


def test_receive_async_reads_back_what_encode_wrote():
    payload = numpy.arange(1000, dtype=numpy.float32).tobytes()
    assert receive_fed(encode(HEADER, payload)) == (HEADER, payload)


def test_receive_async_reads_a_message_with_an_empty_payload():
    assert receive_fed(encode({"op": "end"})) == ({"op": "end"}, b"")


def test_receive_async_reads_a_message_fed_in_small_chunks():
    encoded = encode(HEADER, b"abcdefgh")
    chunks = [encoded[index:index + 3] for index in range(0, len(encoded), 3)]
    assert receive_fed(*chunks) == (HEADER, b"abcdefgh")


def test_receive_async_reads_consecutive_messages_in_order():
    async def main():
        reader = feed(encode({"n": 1}, b"a"), encode({"n": 2}), encode({"n": 3}, b"ccc"))
        return [await receive_async(reader) for _ in range(3)]

    assert asyncio.run(main()) == [({"n": 1}, b"a"), ({"n": 2}, b""), ({"n": 3}, b"ccc")]


def test_receive_async_reads_the_largest_payload_allowed():
    payload = b"\x5a" * (2 * FRAGMENT_BYTES)
    header, received = receive_fed(encode({"op": "initial"}, payload))
    assert header == {"op": "initial"} and received == payload


@pytest.mark.parametrize("cut", [0, 5, LENGTHS.size, LENGTHS.size + 3, -1], ids=["nothing", "lengths", "header",
                                                                                "mid-header", "payload"])
def test_receive_async_on_a_stream_closed_mid_message_raises_a_sync_wire_error(cut):
    with pytest.raises(SyncWireError, match="closed"):
        receive_fed(encode(HEADER, b"0123456789")[:cut])


def test_receive_async_refuses_a_header_over_max_header_before_reading_it():
    # No eof and nothing after the lengths: a receiver that read the header would wait out wait_for's timeout.
    with pytest.raises(SyncWireError, match="is not one this lab sends"):
        receive_fed(LENGTHS.pack(MAX_HEADER + 1, 0), eof=False)


def test_receive_async_refuses_a_payload_over_two_fragments_before_reading_it():
    with pytest.raises(SyncWireError, match="is not one this lab sends"):
        receive_fed(LENGTHS.pack(2, 2 * FRAGMENT_BYTES + 1) + b"{}", eof=False)


@pytest.mark.parametrize("blocking", [True, False], ids=["receive", "receive_async"])
@pytest.mark.parametrize("text", [b"{nope", b"[1,2]"], ids=["not json", "not an object"])
def test_a_header_that_is_not_a_json_object_raises_a_sync_wire_error(pair, blocking, text):
    message = LENGTHS.pack(len(text), 0) + text
    with pytest.raises(SyncWireError, match="header is not"):
        if blocking:
            pair[0].sendall(message)
            receive(pair[1])
        else:
            receive_fed(message)


# -- fragments -------------------------------------------------------------------------


def check_fragments(data: bytes, item_bytes: int, limit: int) -> list:
    pieces = list(fragments(data, item_bytes))
    assert b"".join(bytes(piece) for _, _, piece in pieces) == data
    first = 0
    for index, count, piece in pieces:
        assert 0 < len(piece) <= limit
        assert len(piece) % item_bytes == 0
        assert index == first and count == len(piece) // item_bytes
        assert bytes(piece) == data[index * item_bytes:(index + count) * item_bytes]
        first += count
    assert first * item_bytes == len(data)
    return pieces


@pytest.mark.parametrize("item_bytes", [2, 4])
def test_fragments_of_real_size_cut_at_element_boundaries_and_join_back(item_bytes):
    data = numpy.random.default_rng(item_bytes).integers(0, 256, 2 * FRAGMENT_BYTES + 1000 * item_bytes,
                                                         dtype=numpy.uint8).tobytes()
    pieces = check_fragments(data, item_bytes, FRAGMENT_BYTES)
    assert [len(piece) for _, _, piece in pieces] == [FRAGMENT_BYTES, FRAGMENT_BYTES, 1000 * item_bytes]
    assert [index for index, _, _ in pieces] == [0, FRAGMENT_BYTES // item_bytes, 2 * FRAGMENT_BYTES // item_bytes]


@pytest.mark.parametrize("item_bytes", [2, 3, 4, 6])
@pytest.mark.parametrize("elements", [1, 4, 5, 17, 100])
def test_fragments_cut_at_element_boundaries_whether_or_not_the_element_size_divides_the_fragment_size(
        monkeypatch, item_bytes, elements):
    monkeypatch.setattr(sync_messages, "FRAGMENT_BYTES", 10)
    data = bytes(index % 251 for index in range(elements * item_bytes))
    pieces = check_fragments(data, item_bytes, 10)
    assert all(len(piece) == 10 - 10 % item_bytes for _, _, piece in pieces[:-1])


def test_data_that_fits_in_one_fragment_is_one_fragment():
    data = numpy.arange(100, dtype=numpy.float32).tobytes()
    [(index, count, piece)] = fragments(data, 4)
    assert (index, count, bytes(piece)) == (0, 100, data)


def test_empty_data_has_no_fragments():
    assert list(fragments(b"", 4)) == []


def test_fragments_take_a_typed_memoryview_and_count_its_elements():
    values = numpy.arange(3 * FRAGMENT_BYTES // 4 // 2, dtype=numpy.float32)  # one and a half fragments
    pieces = check_fragments(values.tobytes(), 4, FRAGMENT_BYTES)
    from_view = list(fragments(memoryview(values), 4))
    assert [(index, count, bytes(piece)) for index, count, piece in from_view] == \
        [(index, count, bytes(piece)) for index, count, piece in pieces]
    assert [count for _, count, _ in from_view] == [FRAGMENT_BYTES // 4, len(values) - FRAGMENT_BYTES // 4]


def test_fragments_share_the_data_rather_than_copy_it():
    data = bytearray(b"\x00" * 8)
    [(_, _, piece)] = fragments(data, 4)
    data[0] = 9
    assert piece[0] == 9
