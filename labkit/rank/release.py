"""A failing rank lets its peers go at once, instead of at the collective's time limit.

When a rank's work fails, its peers may be waiting for it inside a collective.
gloo tells them only when the connection closes, and the failed step's frames
(a DDP reducer, the training state) keep this rank's gloo context, and so its
connections, alive: a peer that talks only to this rank waits until the limit
(measured: 60 s of a 60 s limit with four DDP ranks, one killed). gloo's
``abort()`` does not close them either. So the rank shuts down every TCP
connection it holds except those to the ipyparallel controller (the engine's
lifeline, whose ports the notebook tells each rank when it assigns it); its peers see "connection
closed" and fail in moments, each closing its own in turn. The process group is
rebuilt on a fresh store afterwards, so nothing needed is lost. NCCL
communicators are aborted through torch, which closes them.
"""

from __future__ import annotations

import os
import socket

import psutil


def close_peer_connections(keep_ports: set[int]) -> int:
    """Shut down every established TCP connection of this process except to ``keep_ports``; how many."""
    closed = 0
    for connection in psutil.Process().net_connections(kind="tcp"):
        if connection.status != psutil.CONN_ESTABLISHED or not connection.raddr or connection.fd < 0:
            continue
        if connection.raddr.port in keep_ports:
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


def release_peers(controller_ports: frozenset[int], backend: str) -> None:
    """Make every peer waiting on this rank fail now (called by a rank whose work failed)."""
    if backend == "nccl":
        from labkit.rank.torch_internals import abort_process_groups

        try:
            abort_process_groups()
        except Exception:  # noqa: BLE001 - already torn down: nothing waits on it
            pass
    if controller_ports:  # without the controller's ports, closing blindly would cut the engine off
        close_peer_connections(set(controller_ports))
