"""A client of a lab's rendezvous store (rank 0's ``TCPStore``), for the notebook and for a rank's side threads.

torch's client retries a refused connection until its timeout: a plain connect first says at once
that nothing listens there (rank 0 died, or the world was formed anew on another port). torch is
imported on first use, so the notebook pays for it only when it talks to the store.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def store_client(host: str, port: int, timeout_seconds: float):
    """A ``TCPStore`` client of the store at ``host:port``; ``OSError`` at once when nothing listens there."""
    socket.create_connection((host, port), timeout=timeout_seconds).close()
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_seconds))
