"""Whether the ranks that joined from other machines still answer, asked before each call.

Runs in the notebook. A rank of the lab's own launcher is a process on this
machine: a frozen one (SIGSTOP) is seen at once and replaced before the call.
A joined rank's process is on another machine; the controller drops it only
~2.4 s after its heartbeats stop, and a call sent before that waited for a rank
that could not run it, and failed. So before a call the notebook sends every
joined rank a request that returns at once: those that answer are working; for
one that does not, the notebook waits for the controller's verdict (it answers
late: a slow link; it is dropped: frozen or cut off, and the next heal drops
it before the call, as a frozen rank of this machine is replaced).

When a request of a rank the controller dropped is answered after all (the
process was resumed with SIGCONT), ipyparallel's client prints the raw reply:
``quiet_late_replies`` says it in one line instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

VERDICT_SECONDS = 4.0  # the controller drops a silent engine ~2.4 s after its last heartbeat
POLL_SECONDS = 0.02


def hear_from_joined(cluster) -> None:
    """Ask each joined rank the controller lists for an answer that comes at once; return when each answered
    or was dropped by the controller, or after ``VERDICT_SECONDS``."""
    client = cluster.client
    engines = {rank: record.engine for rank, record in cluster.records.items()
               if client is not None and record.joined and record.engine in client.ids}
    if not engines:
        return
    asked = {}
    for rank, engine in engines.items():
        try:
            asked[rank] = client[engine].apply_async(os.getpid)
        except Exception:  # noqa: BLE001 - dropped meanwhile: the heal that follows sees it
            continue
    began = time.monotonic()
    silent = set(asked)
    while time.monotonic() - began < VERDICT_SECONDS:
        silent = {rank for rank in silent if not asked[rank].ready()}
        if all(engines[rank] not in client.ids for rank in silent):
            break  # each answered, or has the controller's verdict
        time.sleep(POLL_SECONDS)
    answered = [result.msg_ids[0] for rank, result in asked.items() if rank not in silent]
    if answered:
        client.purge_local_results(jobs=answered)


def quiet_late_replies(client, say: Callable[[str], None] = print):
    """A reply to a request the client stopped waiting for (its engine was dropped, then resumed) is said in
    one line by ``say`` and set aside, instead of ipyparallel's prints of the raw reply; ``client``."""
    for kind in ("apply_reply", "execute_reply"):
        handle = client._queue_handlers[kind]  # ipyparallel's own table of reply handlers

        def guarded(message, handle=handle):
            metadata = message.get("metadata", {})
            request = metadata.get("original_msg_id") if metadata.get("is_coalescing") else None
            request = request or message.get("parent_header", {}).get("msg_id")
            late = request not in client.outstanding and request in client.history
            if late:
                client.outstanding.add(request)  # handled as any reply: ipyparallel prints nothing
            handle(message)
            if late:
                client.results.pop(request, None)
                client.metadata.pop(request, None)
                say("labkit: a late reply from an engine the controller had dropped (frozen, then resumed?) "
                    "was set aside; the lab goes on without that engine")

        client._queue_handlers[kind] = guarded
    return client
