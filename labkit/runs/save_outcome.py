"""A save that did not complete (Ctrl-C, a rank lost, the time limit): what its path holds now, said first.

A save writes into a ``.partial-`` folder and puts it in place only once it is
complete (``rank.checkpoint``), so a save cut at any instant leaves the old
checkpoint or the new one whole. What the ranks report of the cut (DCP wraps an
interrupt in a ``CheckpointException`` naming every rank) does not say which: this
module tidies what the cut save left beside the path (``checkpoint_files.tidy``,
which the next save would do) and then looks at the path itself, so the error
says which checkpoint is there, at which step, and that nothing half-written is
left.
"""

from __future__ import annotations

import os

from labkit.spec.checkpoint_files import META_FILE, leftovers, read_json, tidy
from labkit.spec.errors import RankFailure, RankInterrupted, RankTimeout


class SaveFailed(RankFailure):
    """A save that did not complete; ``outcome`` says what its path holds now."""

    def __init__(self, outcome: str, reports, **details) -> None:
        self.outcome = outcome  # before the base class builds its message from summary()
        super().__init__(reports, **details)

    def summary(self) -> str:
        return f"{self.outcome}; {super().summary()}"


class SaveInterrupted(SaveFailed, RankInterrupted):
    """A save cut by an interrupt (the notebook's stop button, Ctrl-C)."""


class SaveTimedOut(SaveFailed, RankTimeout):
    """A save that did not finish within its time limit."""


def record_at(target: str) -> bytes | None:
    """The bytes of the ``labkit.json`` of the checkpoint at ``target``: which checkpoint is there."""
    try:
        with open(os.path.join(target, META_FILE), "rb") as handle:
            return handle.read()
    except OSError:
        return None


def _step(target: str) -> str:
    meta = read_json(target) or {}
    return f"step {meta['step']}" if "step" in meta else "its step unreadable"


def outcome(target: str, before: bytes | None, interrupted: bool) -> str:
    """What ``target`` holds after a save to it failed (``before``: ``record_at`` before the save), once the
    save's leftovers are tidied."""
    try:
        tidy(target)
    except OSError:
        pass  # said below: what is still there is named
    after = record_at(target)
    cut = "was cut by the interrupt" if interrupted else "did not complete"
    if after is not None and after == before:
        held = f"the checkpoint there ({_step(target)}) is intact"
    elif after is not None:
        held = f"the new checkpoint ({_step(target)}) was already complete and is in place"
    elif before is not None:
        held = "no checkpoint is there now"
    else:
        held = "nothing was saved there"
    left = leftovers(target)
    tail = (f"; {', '.join(os.path.basename(path) for path in left)} beside it could not be removed (the next "
            "save to that path removes it)") if left else ", and nothing half-written is left"
    return f"the save to {target} {cut}: {held}{tail}"


def save_failure(failure: RankFailure, target: str, before: bytes | None) -> SaveFailed:
    """``failure`` of a save to ``target``, telling first what the path holds now."""
    interrupted = isinstance(failure, RankInterrupted)
    kind = SaveInterrupted if interrupted else SaveTimedOut if isinstance(failure, RankTimeout) else SaveFailed
    said = outcome(target, before, interrupted)
    return kind(said, failure.reports, timed_out=failure.timed_out, timeout_seconds=failure.timeout_seconds,
                interrupted=failure.interrupted, replaced=failure.replaced, recovery=failure.recovery,
                deadlock=failure.deadlock)
