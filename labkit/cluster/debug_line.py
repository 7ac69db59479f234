"""The notebook's line to a rank stopped at a breakpoint: through the ranks' store, not ipyparallel.

A rank stopped at ``breakpoint()`` has its engine's main thread in the debugger
(``rank.debugger``), so ipyparallel cannot deliver anything to it. The ranks'
rendezvous store (rank 0 serves it from a C++ thread) still answers: the rank
wrote where it stopped under ``DEBUG_STOP_KEY``, polls ``DEBUG_COMMAND_KEY`` for
the next pdb command and answers under ``DEBUG_ANSWER_KEY``. Each command names
the stop it is for and a sequence number, so an answer is never taken for the
wrong command, nor a command for a stop that has gone on.

The client is the notebook's own (as ``control``'s and ``rank_whereabouts``'),
made when the first stop is served; torch is loaded by then (the whereabouts
reader that noticed the stop loaded it).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

from labkit.wire.store_client import store_client
from labkit.wire.store_keys import DEBUG_ANSWER_KEY, DEBUG_COMMAND_KEY, DEBUG_STOP_KEY

POLL_SECONDS = 0.005
ALIVE_CHECK_SECONDS = 0.5
STORE_TIMEOUT_SECONDS = 5.0


class DebugLine:
    """Commands to stopped ranks and their answers, through the store at ``address``."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self._client = None
        self._sequence = itertools.count(1)

    def _connected(self):
        if self._client is None:
            self._client = store_client(*self.address, STORE_TIMEOUT_SECONDS)
        return self._client

    def stop_of(self, rank: int) -> dict | None:
        """Where ``rank`` is stopped now (``stop``, ``where``, ``text``), or None when it is not."""
        client = self._connected()
        key = DEBUG_STOP_KEY.format(rank=rank)
        if not client.check([key]):
            return None
        return json.loads(client.get(key))

    def command(self, rank: int, stop: str, line: str, condition: Callable[[], str | None]) -> dict | str:
        """Send ``line`` to ``rank``'s stop ``stop``; its answer (``text``, ``resumes``: None while it stays
        stopped, else 'continue', 'step' or 'quit'), or why it cannot answer: ``condition()`` (checked every
        ``ALIVE_CHECK_SECONDS``) says the rank died or froze."""
        client = self._connected()
        sequence = next(self._sequence)
        answer_key = DEBUG_ANSWER_KEY.format(rank=rank)
        client.delete_key(answer_key)
        client.set(DEBUG_COMMAND_KEY.format(rank=rank), json.dumps({"stop": stop, "seq": sequence, "line": line}))
        next_check = time.monotonic() + ALIVE_CHECK_SECONDS
        while True:
            if client.check([answer_key]):
                answer = json.loads(client.get(answer_key))
                client.delete_key(answer_key)
                if answer.get("stop") == stop and answer.get("seq") == sequence:
                    return answer
            if time.monotonic() >= next_check:
                reason = condition()
                if reason is not None:
                    return reason
                next_check = time.monotonic() + ALIVE_CHECK_SECONDS
            time.sleep(POLL_SECONDS)
