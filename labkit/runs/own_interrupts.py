"""A KeyboardInterrupt the work raised itself, told apart from one the lab caused.

A rank reports a KeyboardInterrupt as an interruption (``FailureKind.INTERRUPTED``): what the lab's
signal makes past a cell's limit or after the kernel's interrupt. A cell can also raise one itself
(``raise KeyboardInterrupt``); said as an interruption it reads as a limit reached that was not.
"""

from __future__ import annotations

from labkit.wire.schema import FailureKind, RankReport

# What a KeyboardInterrupt the work raised itself says, when it says nothing.
OWN_INTERRUPT = "raised by the work itself (no limit was reached and nothing interrupted the rank)"


def told_as_raised(reports: dict[int, RankReport], signalled: bool) -> None:
    """Unless the lab signalled ranks (past the limit, or after the kernel's interrupt: ``signalled``), a
    KeyboardInterrupt that the runtime's guard caught is what the work raised: told so, in ``reports`` itself."""
    if signalled:
        return
    for report in reports.values():
        error = report.get("error")
        guarded = "groups" in report  # the runtime's own report (dispatch's, for a lost answer, has none)
        if guarded and error is not None and error["kind"] == FailureKind.INTERRUPTED \
                and error["type"] == "KeyboardInterrupt":
            error["kind"] = FailureKind.RAISED
            error["message"] = error["message"] or OWN_INTERRUPT
