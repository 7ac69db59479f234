"""Delay on a link where the kernel has no netem: packets held in user space through NFQUEUEs.

Run inside a host's network namespace, after iptables rules send the packets that arrive there to
queues, one queue for each delay (``SiteNetwork`` adds them, by the sender's address)::

    python tests/link_delay.py QUEUE:DELAY_MS [QUEUE:DELAY_MS ...]

It binds the queues over one netlink socket (nfnetlink_queue: the kernel hands each packet's number,
not its bytes), prints "ready", and lets each packet go DELAY_MS after it arrived. Within a queue
every packet waits the same time, so they leave in the order they came: one batch verdict (accept
every packet up to a number) releases all that are due. The queues fail open (a packet a queue has
no room for passes at once) and take whole GSO packets. SIGTERM or SIGINT end it; the kernel drops
its queues then, and the rules' ``--queue-bypass`` lets packets through unqueued.

Why on arrival only: a packet held on its way out still counts against its socket's small-queue
budget (TCP Small Queues), which would cap a connection at a few packets per delay; one held where
it arrives has left its sender. So the receiving host holds a packet for the delays of both links
it crossed, the sender's and its own.

Only the standard library: the netlink messages are packed here (linux/netfilter/nfnetlink_queue.h).
"""

from __future__ import annotations

import collections
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
MAX_QUEUED = 65536

HEADER = struct.Struct("=IHHII")      # nlmsghdr: length, type, flags, sequence, port
FAMILY = struct.Struct("=BBH")        # nfgenmsg: family, version, queue number (big-endian)
ATTRIBUTE = struct.Struct("=HH")      # nlattr: length, type


def attribute(kind: int, payload: bytes) -> bytes:
    padded = payload + b"\0" * (-len(payload) % 4)
    return ATTRIBUTE.pack(ATTRIBUTE.size + len(payload), kind) + padded


def message(kind: int, queue: int, attributes: bytes, flags: int = NLM_F_REQUEST, sequence: int = 0) -> bytes:
    body = FAMILY.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    return HEADER.pack(HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, sequence, 0) + body


def configure(sock: socket.socket, queue: int) -> None:
    """Bind ``queue``, ask for each packet's number only, fail open, take GSO packets whole; check each ack."""
    flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    for sequence, attributes in enumerate((
            attribute(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)),
            attribute(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
            + attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", MAX_QUEUED))
            + attribute(NFQA_CFG_MASK, struct.pack(">I", flags)) + attribute(NFQA_CFG_FLAGS, struct.pack(">I", flags))),
            start=1):
        sock.send(message(NFQNL_MSG_CONFIG, queue, attributes, NLM_F_REQUEST | NLM_F_ACK, sequence))
        reply = sock.recv(65536)
        length, kind, _, _, _ = HEADER.unpack_from(reply)
        error = struct.unpack_from("=i", reply, HEADER.size)[0] if kind == NLMSG_ERROR else 0
        if error:
            raise OSError(-error, f"configuring NFQUEUE {queue}: {os.strerror(-error)}")


def packet_numbers(data: bytes):
    """The packet number of each queued-packet message in one netlink read."""
    offset = 0
    while offset + HEADER.size <= len(data):
        length, kind, _, _, _ = HEADER.unpack_from(data, offset)
        if length < HEADER.size:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            position, end = offset + HEADER.size + FAMILY.size, offset + length
            while position + ATTRIBUTE.size <= end:
                size, attr_kind = ATTRIBUTE.unpack_from(data, position)
                if size < ATTRIBUTE.size:
                    break
                if attr_kind & 0x3FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from(">I", data, position + ATTRIBUTE.size)[0]
                    break
                position += (size + 3) & ~3
        offset += (length + 3) & ~3


def release_through(sock: socket.socket, queue: int, number: int) -> None:
    """Accept every queued packet numbered up to ``number``."""
    sock.send(message(NFQNL_MSG_VERDICT_BATCH, queue, attribute(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, number))))


def queue_of(data: bytes, offset: int) -> int:
    return socket.ntohs(FAMILY.unpack_from(data, offset + HEADER.size)[2])


def run(delays: dict[int, float]) -> None:
    """Hold the packets of each queue for its delay (seconds) until SIGTERM or SIGINT."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    for queue in delays:
        configure(sock, queue)
    held = {queue: collections.deque() for queue in delays}  # queue -> (when due, packet number), in order
    stopping = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.append(True))
    print("ready", flush=True)
    while not stopping:
        soonest = min((waiting[0][0] for waiting in held.values() if waiting), default=None)
        wait = 0.5 if soonest is None else max(0.0, soonest - time.monotonic())
        try:
            readable, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        now = time.monotonic()
        if readable:
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                data = b""
            except OSError as error:  # ENOBUFS: notices were lost; the next batch verdict covers their packets
                print(f"link_delay: {error}", file=sys.stderr, flush=True)
                data = b""
            if len(data) >= HEADER.size + FAMILY.size:
                queue = queue_of(data, 0)
                if queue in held:
                    held[queue].extend((now + delays[queue], number) for number in packet_numbers(data))
        for queue, waiting in held.items():
            due = None
            while waiting and waiting[0][0] <= now:
                due = waiting.popleft()[1]
            if due is not None:
                release_through(sock, queue, due)
    for queue, waiting in held.items():
        if waiting:
            release_through(sock, queue, waiting[-1][1])
    sock.close()


if __name__ == "__main__":
    run({int(queue): float(milliseconds) / 1000.0
         for queue, milliseconds in (argument.split(":") for argument in sys.argv[1:])})
