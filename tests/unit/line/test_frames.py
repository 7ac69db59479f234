"""The line's frames and the bookkeeping that survives a reconnect: encoding, refusals, numbering, replay.

``Outbox``/``Inbox`` are exercised alone, then as the two ends of a line whose websocket drops now
and then: whatever is cut, replaying ``after(peer.received)`` delivers every frame once and in order.
"""

import random

import pytest

from labkit.line import frames
from labkit.line.frames import (ACK, CLOSE, CONTROL, DATA, HEADER, KEEP, OPEN, Frame, Inbox, LineProtocolError,
                                Outbox, decode)


def test_a_frame_comes_back_as_it_was_encoded():
    frame = Frame(DATA, 7, 3, b"some bytes \x00\xff")
    assert decode(frame.encode()) == frame


def test_a_frame_decodes_from_a_bytearray_or_memoryview():
    encoded = Frame(OPEN, 1, 5, b"registration").encode()
    assert decode(bytearray(encoded)) == decode(memoryview(encoded)) == decode(encoded)


def test_an_unnumbered_frame_with_an_empty_payload_round_trips():
    assert decode(frames.KEEP_FRAME) == Frame(KEEP, 0, 0, b"")


def test_an_ack_carries_the_number_it_acknowledges():
    assert frames.acked_number(decode(frames.ack(123456789))) == 123456789


def test_a_control_message_is_a_numbered_kind_with_json():
    kind, stream, payload = frames.control({"op": "engines", "pids": [1, 2]})
    assert (kind, stream) == (CONTROL, 0)
    assert Frame(kind, 1, stream, payload).json() == {"op": "engines", "pids": [1, 2]}


def test_a_frame_shorter_than_its_header_is_refused():
    with pytest.raises(LineProtocolError, match="shorter than its header"):
        decode(Frame(DATA, 1, 1, b"").encode()[:HEADER.size - 1])


def test_an_empty_message_is_refused():
    with pytest.raises(LineProtocolError):
        decode(b"")


def test_a_text_message_is_refused():
    with pytest.raises(LineProtocolError):
        decode("a text message of more than thirteen characters")


def test_an_unknown_kind_is_refused():
    with pytest.raises(LineProtocolError, match="unknown frame kind 99"):
        decode(HEADER.pack(99, 1, 0))


def test_kind_zero_is_unknown():
    with pytest.raises(LineProtocolError, match="unknown frame kind 0"):
        decode(HEADER.pack(0, 0, 0))


@pytest.mark.parametrize("kind", [OPEN, DATA, CLOSE, CONTROL])
def test_a_numbered_kind_with_number_zero_is_refused(kind):
    with pytest.raises(LineProtocolError, match="numbered 0"):
        decode(HEADER.pack(kind, 0, 1))


@pytest.mark.parametrize("kind", [ACK, KEEP])
def test_an_unnumbered_kind_with_a_number_is_refused(kind):
    with pytest.raises(LineProtocolError, match="numbered 4"):
        decode(HEADER.pack(kind, 4, 0) + bytes(8))


# -- Outbox ----------------------------------------------------------------------------


def test_the_outbox_numbers_frames_from_one():
    outbox = Outbox()
    numbers = [decode(outbox.stamp(DATA, 1, b"x")).seq for _ in range(3)]
    assert numbers == [1, 2, 3]
    assert outbox.next_seq == 4


def test_the_outbox_keeps_the_stamped_bytes_and_counts_them():
    outbox = Outbox()
    first = outbox.stamp(OPEN, 1, b"mux")
    second = outbox.stamp(DATA, 1, b"payload")
    assert [encoded for _, encoded in outbox.unacked] == [first, second]
    assert outbox.bytes == len(first) + len(second)


@pytest.mark.parametrize("kind", [ACK, KEEP])
def test_the_outbox_refuses_to_number_an_unnumbered_kind(kind):
    with pytest.raises(ValueError, match="not numbered"):
        Outbox().stamp(kind, 0, b"")


def test_acknowledged_forgets_the_frames_up_to_that_number():
    outbox = Outbox()
    sent = [outbox.stamp(DATA, 1, bytes(10)) for _ in range(5)]
    outbox.acknowledged(3)
    assert [number for number, _ in outbox.unacked] == [4, 5]
    assert outbox.bytes == len(sent[3]) + len(sent[4])


def test_acknowledging_everything_empties_the_outbox():
    outbox = Outbox()
    for _ in range(4):
        outbox.stamp(DATA, 1, b"abc")
    outbox.acknowledged(4)
    assert not outbox.unacked and outbox.bytes == 0


def test_an_older_acknowledgement_changes_nothing():
    outbox = Outbox()
    for _ in range(4):
        outbox.stamp(DATA, 1, b"abc")
    outbox.acknowledged(3)
    outbox.acknowledged(1)
    assert [number for number, _ in outbox.unacked] == [4]


def test_acknowledging_beyond_what_was_sent_is_a_protocol_error():
    outbox = Outbox()
    outbox.stamp(DATA, 1, b"abc")
    with pytest.raises(LineProtocolError, match="only 1 were sent"):
        outbox.acknowledged(2)


def test_acknowledging_anything_of_an_empty_outbox_but_zero_is_a_protocol_error():
    outbox = Outbox()
    outbox.acknowledged(0)
    with pytest.raises(LineProtocolError):
        outbox.acknowledged(1)


def test_after_gives_exactly_what_the_peer_lacks():
    outbox = Outbox()
    sent = [outbox.stamp(DATA, 1, bytes([n])) for n in range(6)]
    assert outbox.after(2) == sent[2:]
    assert outbox.after(6) == []


def test_after_forgets_what_the_peer_has():
    outbox = Outbox()
    for n in range(6):
        outbox.stamp(DATA, 1, bytes([n]))
    outbox.after(4)
    assert [number for number, _ in outbox.unacked] == [5, 6]


def test_after_a_number_never_sent_is_a_protocol_error():
    outbox = Outbox()
    outbox.stamp(DATA, 1, b"x")
    with pytest.raises(LineProtocolError):
        outbox.after(5)


def test_the_outbox_is_full_at_its_limit():
    size = len(Frame(DATA, 1, 1, bytes(100)).encode())
    outbox = Outbox(limit=3 * size)
    outbox.stamp(DATA, 1, bytes(100))
    outbox.stamp(DATA, 1, bytes(100))
    assert not outbox.full
    outbox.stamp(DATA, 1, bytes(100))
    assert outbox.full


def test_the_outbox_has_room_again_once_acknowledged():
    outbox = Outbox(limit=10)
    outbox.stamp(DATA, 1, bytes(100))
    assert outbox.full
    outbox.acknowledged(1)
    assert not outbox.full


# -- Inbox -----------------------------------------------------------------------------


def test_the_inbox_accepts_frames_in_order():
    inbox = Inbox()
    assert all(inbox.accept(Frame(DATA, n, 1, b"ab")) for n in (1, 2, 3))
    assert inbox.received == 3


def test_the_inbox_counts_the_bytes_it_has_not_acknowledged():
    inbox = Inbox()
    inbox.accept(Frame(DATA, 1, 1, bytes(50)))
    assert inbox.unacked_bytes == 50 + HEADER.size


def test_the_inbox_drops_a_frame_it_has_seen():
    inbox = Inbox()
    inbox.accept(Frame(DATA, 1, 1, b"a"))
    inbox.accept(Frame(DATA, 2, 1, b"b"))
    assert inbox.accept(Frame(DATA, 1, 1, b"a")) is False
    assert inbox.accept(Frame(DATA, 2, 1, b"b")) is False
    assert inbox.received == 2


def test_the_inbox_refuses_a_gap():
    inbox = Inbox()
    inbox.accept(Frame(DATA, 1, 1, b"a"))
    with pytest.raises(LineProtocolError, match="frame 3 came after frame 1"):
        inbox.accept(Frame(DATA, 3, 1, b"c"))


def test_the_inbox_lets_unnumbered_frames_through_without_counting_them():
    inbox = Inbox()
    assert inbox.accept(decode(frames.KEEP_FRAME))
    assert inbox.accept(decode(frames.ack(0)))
    assert inbox.received == 0


# -- two ends across drops ---------------------------------------------------------------


class End:
    """One end of a simulated line: what it sends, what it received in order."""

    def __init__(self) -> None:
        self.outbox, self.inbox = Outbox(), Inbox()
        self.delivered: list[bytes] = []
        self.made: list[bytes] = []

    def make(self, count: int, rng: random.Random) -> list[bytes]:
        encoded = []
        for _ in range(count):
            payload = f"{id(self)}:{len(self.made)}".encode() + bytes(rng.randrange(20))
            self.made.append(payload)
            encoded.append(self.outbox.stamp(DATA, 1, payload))
        return encoded

    def take(self, encoded: bytes) -> None:
        frame = decode(encoded)
        if frame.kind == ACK:
            self.outbox.acknowledged(frames.acked_number(frame))
        elif self.inbox.accept(frame):
            self.delivered.append(frame.payload)


def test_frames_cross_a_line_that_drops_exactly_once_and_in_order():
    rng = random.Random(20240611)
    left, right = End(), End()
    for _connection in range(40):
        # A new websocket: each end says what it received, the other sends again what came after.
        to_right, to_left = left.outbox.after(right.inbox.received), right.outbox.after(left.inbox.received)
        for _ in range(rng.randrange(1, 15)):
            to_right += left.make(rng.randrange(4), rng)
            to_left += right.make(rng.randrange(4), rng)
            if rng.random() < 0.3:
                to_right.append(frames.ack(left.inbox.received))
            if rng.random() < 0.3:
                to_left.append(frames.ack(right.inbox.received))
        # The drop: each direction gets through only up to a random cut, the rest is lost on the way.
        for encoded in to_right[:rng.randrange(len(to_right) + 1)]:
            right.take(encoded)
        for encoded in to_left[:rng.randrange(len(to_left) + 1)]:
            left.take(encoded)
    for encoded in left.outbox.after(right.inbox.received):  # a last, whole connection
        right.take(encoded)
    for encoded in right.outbox.after(left.inbox.received):
        left.take(encoded)
    assert right.delivered == left.made and left.delivered == right.made
    assert len(left.made) > 100 and len(right.made) > 100


def test_frames_sent_again_after_a_reconnect_are_dropped_once_delivered():
    sender, receiver = End(), End()
    rng = random.Random(7)
    first = sender.make(5, rng)
    for encoded in first:  # all arrived, but the acknowledgement was lost with the websocket
        receiver.take(encoded)
    for encoded in sender.outbox.after(0):  # a sender that believes nothing arrived sends it all again
        receiver.take(encoded)
    assert receiver.delivered == sender.made
