"""A rank lets its peers go at once when a collective cannot complete, instead of at its time limit.

When a rank's work fails, or it finished while its peers wait for it in a
collective, gloo tells the peers only when the connection closes, and the
failed step's frames (a DDP reducer, the training state) keep this rank's gloo
context, and so its connections, alive: a peer that talks only to this rank
waits until the limit (measured: 60 s of a 60 s limit with four DDP ranks, one
killed). gloo's ``abort()`` does not close them either. So the rank shuts down
the TCP connections of its process groups, which it noted when each group was
built (``rank.lab_groups``): its peers see "connection closed" and fail in
moments. Nothing else is touched: the ipyparallel controller's connections (the
engine's lifeline), the rendezvous store's (the groups are rebuilt on it), and
any connection the user's own code opened. NCCL communicators are aborted
through torch, which closes them.
"""

from __future__ import annotations

import os
import socket
import sys

import psutil


def _address(address) -> tuple[str, int] | None:
    return (address.ip, address.port) if address else None


def _kernel_address(text: str) -> tuple[str, int]:
    """An address as /proc/net/tcp{,6} writes it (hex, in the kernel's byte order) as (ip, port)."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is in the machine's byte order; a v4 address inside a v6 one is ::ffff:a.b.c.d.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
    return ip, int(port, 16)


def established_connections() -> set[tuple]:
    """(local, remote) address pairs of the established TCP connections this process can see.

    Read from the kernel's tables, which is cheap: a group's build notes what appeared while it
    connected. The tables are the network's, not the process's, so other processes' connections
    may be among them; ``close_connections`` only ever finds this process's own."""
    pairs = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] == "01":  # ESTABLISHED
                        pairs.add((_kernel_address(fields[1]), _kernel_address(fields[2])))
    except (OSError, ValueError, StopIteration):  # not Linux: ask psutil
        return {(_address(connection.laddr), _address(connection.raddr))
                for connection in psutil.Process().net_connections(kind="tcp")
                if connection.status == psutil.CONN_ESTABLISHED and connection.raddr}
    return pairs


def close_connections(chosen: set[tuple]) -> int:
    """Shut down those of ``chosen`` (local, remote) connections that are still open; how many."""
    if not chosen:
        return 0
    closed = 0
    for connection in psutil.Process().net_connections(kind="tcp"):
        if connection.fd < 0 or (_address(connection.laddr), _address(connection.raddr)) not in chosen:
            continue
        try:
            duplicate = socket.socket(fileno=os.dup(connection.fd))
        except OSError:
            continue
        try:
            duplicate.shutdown(socket.SHUT_RDWR)  # the connection itself, for every descriptor of it
            closed += 1
        except OSError:
            pass
        finally:
            duplicate.close()
    return closed
