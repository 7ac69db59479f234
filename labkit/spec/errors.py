"""The lab's errors, and how a failure on several ranks is told in one message.

Rank reports are the plain dicts ``wire.entry`` returns. A failure is grouped so
that the cause stands first: ranks that raised (one traceback per distinct
traceback), then ranks that hung and were interrupted, then ranks that only
failed because a peer did (released from a collective), each with a line.
The one-line summary names each distinct error with the first line of its
message, so the cause can be read without scrolling to the tracebacks. Errors
count as the same when they differ only in what differs by process (addresses,
ports, ids: ``spec.error_text``); the lowest rank's text is the one shown.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

from labkit.spec.error_text import comparable, group_alike
from labkit.wire.schema import ErrorInfo, FailureKind, RankReport


class ShortTraceback:
    """Mixin: IPython shows just "Type: message", not the lab's own call stack.

    These errors explain themselves; the frames inside labkit that raised them
    would only hide the message in a notebook. Scripts still get the traceback.
    """

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines() or [""]
        return [f"{type(self).__name__}: {lines[0]}", *lines[1:]]


class LabError(ShortTraceback, RuntimeError):
    """Base class of everything the lab raises on purpose."""


class LabConfigError(ShortTraceback, ValueError):
    """A request the lab refuses before anything runs (a ValueError)."""


class StartupError(LabError):
    """Ranks did not come up; nothing the lab started is left running."""


class LabBusy(LabError):
    """The ranks are busy with a training run in the background."""


class LabNotRunning(LabError):
    """The lab was asked to work before ``start()`` or after ``stop()``."""


def format_ranks(ranks) -> str:
    ranks = sorted(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(str(rank) for rank in ranks)}"


# What commonly stops a rank with a signal, for people reading a failure.
_SIGNAL_CAUSES = {
    "SIGKILL": "killed: by someone (kill -9, %lab kill) or by the kernel's out-of-memory killer",
    "SIGABRT": "aborted by torch's C++ code: commonly a collective whose tensor sizes, dtypes or order "
               "differ between ranks (start the lab with check_collectives=True to have the mismatch "
               "named), or a failed internal check; its log has the reason",
    "SIGSEGV": "crashed (segmentation fault) in native code",
    "SIGBUS": "crashed (bus error): often shared memory (/dev/shm) running out",
    "SIGTERM": "terminated by a signal asking it to end",
    "SIGINT": "interrupted",
}


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: 'exit code 3', or the signal that ended it and its usual cause."""
    if code is None:
        return "exit code unknown"
    if code >= 0:
        return f"exit code {code}"
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    cause = _SIGNAL_CAUSES.get(name)
    return f"{name} (exit code {code}){': ' + cause if cause else ''}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _plain_message(text: str) -> str:
    """A collective's error without what differs between ranks (source paths, peer ports)."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", _last_line(text))
    text = re.sub(r"\[[0-9a-fA-F.:]+\]:\d+", "[peer]", text)
    return text.split(". ")[0].rstrip(".")


# A summary is one line; a message longer than this is cut ("..." shows where).
SUMMARY_MESSAGE_CHARS = 200
# Past this many distinct messages the summary only names the ranks; the tracebacks say the rest.
SUMMARY_MESSAGES = 3


def _first_line(message: str) -> str:
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[0] if lines else ""


def _headline(line: str) -> str:
    """An error message's first line, shortened to fit a one-line summary."""
    if len(line) > SUMMARY_MESSAGE_CHARS:
        line = line[: SUMMARY_MESSAGE_CHARS - 3].rstrip() + "..."
    return line


def _raised_parts(raised: dict[int, ErrorInfo]) -> list[str]:
    """'ranks 0, 2 raised ValueError: boom' per distinct (type, first line), in rank order."""
    # (type, first line as compared) -> (type, the lowest rank's headline, ranks)
    by_cause: dict[tuple[str, str], tuple[str, str, list[int]]] = {}
    for rank, error in raised.items():
        line = _first_line(error.get("message", ""))
        cause = by_cause.setdefault((error["type"], comparable(line, rank)), (error["type"], _headline(line), []))
        cause[2].append(rank)
    causes = list(by_cause.values())
    # Ranks that each word their error differently (a rank number in it) would
    # make the summary a paragraph: beyond a few, fold them into one part per type.
    folded = defaultdict(list)
    for error_type, _, ranks in causes[SUMMARY_MESSAGES:]:
        folded[error_type].extend(ranks)
    parts = [
        f"{format_ranks(ranks)} raised {error_type}" + (f": {headline}" if headline else "")
        for error_type, headline, ranks in causes[:SUMMARY_MESSAGES]
    ]
    parts += [f"{format_ranks(ranks)} raised {error_type} (other messages)" for error_type, ranks in folded.items()]
    return parts


def _were(ranks) -> str:
    return "was" if len(ranks) == 1 else "were"


# A rank's error that only says its peer went away: the consequence of another rank's failure,
# whatever path of the rank's code it was raised in.
_CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _is_consequence(error: ErrorInfo) -> bool:
    return any(marker in (error.get("message") or "") for marker in _CONSEQUENCE_MARKERS)


class RankFailure(LabError):
    """Work failed on some ranks. ``reports`` holds every rank's report by rank."""

    def __init__(
        self,
        reports: Mapping[int, RankReport],
        timed_out: bool = False,
        timeout_seconds: float | None = None,
        interrupted: bool = False,
        replaced: tuple[int, ...] = (),
        recovery: str = "",
        deadlock: str = "",
    ) -> None:
        """``deadlock``: the deadlock that made the work fail (``runs.deadlock``), told first."""
        self.reports = dict(sorted(reports.items()))
        self.deadlock = deadlock
        self.timed_out = timed_out
        self.timeout_seconds = timeout_seconds
        self.interrupted = interrupted
        self.replaced = tuple(sorted(replaced))
        self.recovery = recovery
        super().__init__(self.summary())
        # Scripts print notes under the message; IPython uses _render_traceback_.
        details = self.details()
        if details:
            self.add_note(details)

    # -- grouping -------------------------------------------------------------

    def _errors(self, kind: str) -> dict[int, ErrorInfo]:
        return {
            rank: report["error"]
            for rank, report in self.reports.items()
            if not report.get("ok") and report.get("error", {}).get("kind") == kind
        }

    @property
    def _echoes(self) -> dict[int, ErrorInfo]:
        """Ranks that raised only "connection closed/reset by peer" while another rank failed on its own:
        told as released by that failure, not as causes."""
        raised = self._errors(FailureKind.RAISED)
        echoes = {rank: error for rank, error in raised.items() if _is_consequence(error)}
        own = set(raised) - set(echoes)
        others = own | set(self._errors(FailureKind.DIED)) | set(self._errors(FailureKind.INTERRUPTED))
        return echoes if others else {}

    @property
    def raised(self) -> dict[int, ErrorInfo]:
        echoes = self._echoes
        return {rank: error for rank, error in self._errors(FailureKind.RAISED).items() if rank not in echoes}

    @property
    def causes(self) -> list[int]:
        """The ranks that failed on their own (raised, died, hung), or that skipped a collective the
        others waited in: the other failed ranks only followed them."""
        skipped = self._skipped()
        if skipped:
            return skipped
        return sorted(set(self.raised) | set(self.died) | set(self.hung) | set(self.replaced))

    def _skipped(self) -> list[int]:
        """The ranks that finished while every failed rank only waited for a peer: they skipped a collective."""
        finished = [rank for rank, report in self.reports.items() if report.get("ok")]
        waited = set(self.hung) | set(self._errors(FailureKind.COLLECTIVE))
        if finished and waited and not self.raised and not self.died and not self.interrupted:
            return sorted(finished)
        return []

    @property
    def hung(self) -> dict[int, ErrorInfo]:
        """Ranks the notebook had to interrupt (or replace) to get them back."""
        return self._errors(FailureKind.INTERRUPTED)

    @property
    def released(self) -> dict[int, ErrorInfo]:
        return dict(sorted({**self._errors(FailureKind.COLLECTIVE), **self._echoes}.items()))

    @property
    def died(self) -> dict[int, ErrorInfo]:
        return self._errors(FailureKind.DIED)

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(rank for rank, report in self.reports.items() if not report.get("ok"))

    def summary(self) -> str:
        parts = _raised_parts(self.raised)
        if self.died:
            frozen = [rank for rank, error in self.died.items() if "frozen" in error["message"]]
            lost = [rank for rank, error in self.died.items() if "dropped" in error["message"]]
            exited = [rank for rank in self.died if rank not in frozen and rank not in lost]
            if exited:
                parts.append(f"{format_ranks(exited)} died (process exited)")
            if frozen:
                parts.append(f"{format_ranks(frozen)} froze (stopped by a signal) and {_were(frozen)} ended")
            if lost:
                parts.append(f"{format_ranks(lost)} {_were(lost)} dropped by the controller (no heartbeats: "
                             "ended, frozen, or its host unreachable)")
        if self.hung:
            if self.interrupted:
                parts.append(f"{format_ranks(self.hung)} interrupted")
            else:
                limit = f" within {self.timeout_seconds:g} s" if self.timeout_seconds else ""
                parts.append(f"{format_ranks(self.hung)} did not finish{limit} and {_were(self.hung)} interrupted")
        if self.released:
            causes = self.causes
            why = f"as a consequence of {format_ranks(causes)}" if causes else "waiting on a peer"
            parts.append(f"{format_ranks(self.released)} failed in a collective {why}")
        if self.replaced:
            parts.append(f"{format_ranks(self.replaced)} did not respond and {_were(self.replaced)} replaced by fresh processes")
        if not parts and self.timed_out:
            parts.append(f"the work did not finish within {self.timeout_seconds:g} s")
        finished = self._skipped()
        waited = sorted(set(self.hung) | set(self.released))
        if finished:
            # Nobody failed on its own: the finished ranks left a collective the others were in.
            parts.append(f"{format_ranks(finished)} finished while the others waited in a collective: "
                         f"{'it' if len(finished) == 1 else 'they'} skipped a collective (or called fewer) "
                         f"that {format_ranks(waited)} called")
        said = "; ".join(parts) or "work failed on some ranks"
        return f"{self.deadlock.splitlines()[0]}; {said}" if self.deadlock else said

    def details(self) -> str:
        """Every distinct traceback once, with the ranks that share it (after the deadlock, if one)."""
        blocks = self.deadlock.splitlines()[1:]
        for ranks, text, exact in group_alike({rank: error["traceback"] for rank, error in self.raised.items()}):
            # Say so when the others' copies were not to the letter the same, so no one hunts for them.
            others = "the others differ only in addresses, ports, ids and such"
            shown = "" if exact else f" (rank {ranks[0]}'s shown; {others})"
            blocks.append(f"--- {format_ranks(ranks)}{shown} ---\n{text.rstrip()}")
        # Ranks that died the same way: one explanation.
        for ranks, message, _ in group_alike({rank: error["message"] for rank, error in self.died.items()}):
            blocks.append(f"--- {format_ranks(ranks)} (died) ---\n{message}")
        by_place = defaultdict(list)
        for rank, error in self.hung.items():
            by_place[_last_frame(error["traceback"])].append(rank)
        for place, ranks in by_place.items():
            where = f" while in {place}" if place else ""
            blocks.append(f"--- {format_ranks(ranks)} (interrupted{where}) ---")
        released = {rank: f"{error['type']}: {_plain_message(error['message'])}"
                    for rank, error in self.released.items()}
        causes = self.causes
        consequence = f": a consequence of {format_ranks(causes)}, not a cause" if causes else ""
        for ranks, message, _ in group_alike(released):
            blocks.append(f"--- {format_ranks(ranks)} (released from a collective{consequence}) ---\n{message}")
        if self.recovery:
            blocks.append(self.recovery)
        return "\n".join(blocks)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the notebook-side traceback, which says nothing."""
        return [f"{type(self).__name__}: {self.summary()}", *self.details().splitlines()]


class RankTimeout(RankFailure):
    """Work did not finish within its time limit."""


class RankInterrupted(RankFailure, KeyboardInterrupt):
    """The kernel was interrupted while ranks were working; they were stopped too."""


def _last_frame(traceback_text: str) -> str:
    """'File "<lab cell 3>", line 2' of the innermost frame, if there is one."""
    frames = [line.strip() for line in traceback_text.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return ""
    return frames[-1].split(", in ")[0]
