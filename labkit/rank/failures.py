"""How a rank tells of user work that failed: the kind of failure, the traceback from the user's code down, a hint.

Runs in the engines: ``runtime.RankRuntime`` reports every error of user work
with ``error_info``. The kind tells the notebook whether the rank failed on its
own or because a peer did (``wire.schema.FailureKind``); the hint says what to do
about errors that ranks make where a single process would not.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Collection

import torch.distributed as dist

from labkit.wire.schema import ErrorInfo, FailureKind

# Error text by which a rank knows it failed *because of another rank*: the peer
# closed the connection (it failed first) or the collective timed out waiting.
_COLLATERAL_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "timed out",
    "Broken pipe",
    "NCCL communicator was aborted",
)
# torch's collective checker (check_collectives) meets every member before each collective: a member that
# never came (it skipped the collective, or the lab released the waiting rank) fails the rank with this.
_CHECKER_MARKER = "failed to pass monitoredBarrier"

_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+)")


def error_info(error: BaseException, own_files: Collection[str]) -> ErrorInfo:
    """What a rank reports of ``error``; the traceback leaves out the leading frames of ``own_files`` (the lab's)."""
    return {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": user_traceback(error, own_files) + hint(error),
        "kind": classify_error(error),
    }


def classify_error(error: BaseException) -> str:
    """'interrupted', 'collective' (failed because a peer failed or hung) or 'raised'."""
    if isinstance(error, KeyboardInterrupt):
        return FailureKind.INTERRUPTED
    text = str(error)
    distributed_error = isinstance(error, getattr(dist, "DistError", ())) or "gloo" in text or "c10d" in text
    if distributed_error and any(marker in text for marker in _COLLATERAL_MARKERS) or _CHECKER_MARKER in text:
        return FailureKind.COLLECTIVE
    return FailureKind.RAISED


def hint(error: BaseException) -> str:
    """What to do about an error that ranks make where a single process would not."""
    calls = _FINGERPRINT.findall(str(error))
    if calls:
        said = "; ".join(f"rank {rank} calls {op.lower()} of shape [{shape}] ({dtype.lower()}), its collective "
                         f"number {sequence}" for rank, sequence, op, shape, dtype in calls)
        return f"Hint: the ranks called different collectives at the same point: {said}.\n"
    if isinstance(error, NameError):
        return ("Hint: each rank has its own namespace. Names the notebook defined or imported are not on the "
                "ranks: import inside the function, or run the import in a %%lab cell first.\n")
    return ""


def user_traceback(error: BaseException, own_files: Collection[str]) -> str:
    """The traceback from the user's code down: the lab's wrapper frames (those of ``own_files``) above it left
    out, as IPython leaves out its own; labkit's frames between the start and the user's innermost frame
    (``lab.train``'s loop, its strategies) folded into one line each run, "(4 lab frames hidden)". Frames the
    lab ran after the user's innermost one stay: there the lab itself raised."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in own_files:
        tb = tb.tb_next
    shown = traceback.TracebackException(type(error), error, tb, compact=True)
    seen: set[int] = set()
    pending = [shown]
    while pending:  # the error and those it was raised from or during
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = _LabFramesHidden.of(current.stack)
        pending.extend(chained for chained in (current.__cause__, current.__context__) if chained is not None)
    return "".join(shown.format())


_LAB_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the labkit package's folder


def is_lab_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LAB_FOLDER + os.sep)


class _LabFramesHidden(traceback.StackSummary):
    """A stack whose lab frames above the user's innermost frame are left out, each run said in one line."""

    hidden: dict[int, int]  # index of the frame shown after a run of hidden ones -> how many were hidden

    @classmethod
    def of(cls, stack: traceback.StackSummary) -> _LabFramesHidden:
        frames = list(stack)
        users = [index for index, frame in enumerate(frames) if not is_lab_file(frame.filename)]
        innermost = users[-1] if users else -1
        kept = cls()
        kept.hidden = {}
        run = 0
        for index, frame in enumerate(frames):
            if index < innermost and is_lab_file(frame.filename):
                run += 1
                continue
            if run:
                kept.hidden[len(kept)] = run
                run = 0
            kept.append(frame)
        return kept

    def format(self, **options) -> list[str]:  # Python 3.13 passes options (colorize) on to each frame
        lines = []
        for index, frame in enumerate(self):
            if index in self.hidden:
                count = self.hidden[index]
                lines.append(f"  ({count} lab frame{'s' if count > 1 else ''} hidden)\n")
            formatted = self.format_frame_summary(frame, **options)
            if formatted is not None:
                lines.append(formatted)
        return lines
