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

import psutil


def _address(address) -> tuple[str, int] | None:
    return (address.ip, address.port) if address else None


def established_connections() -> set[tuple]:
    """(local, remote) address pairs of this process's established TCP connections."""
    return {(_address(connection.laddr), _address(connection.raddr))
            for connection in psutil.Process().net_connections(kind="tcp")
            if connection.status == psutil.CONN_ESTABLISHED and connection.raddr}


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
