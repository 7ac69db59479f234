"""``LabWindow``: the part of ``Lab`` that makes the notebook a window onto every rank.

What a person does in a notebook with the objects in front of them, done with the objects that
live on the ranks: run code there and see what it prints and displays (``run_cell``: plots,
tables and rich values as ordinary outputs, one page per rank with ``view``), list them (``who``),
complete their names (``complete``), and stop in a debugger where a rank raised or reached
``breakpoint()`` (``debug``). Each method is a thin front over the session or a feature in
``labkit.runs`` that takes it; the magics call these.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from labkit.runs.cell_stop import iteration_stops, stop_before_iteration
from labkit.spec.errors import LabConfigError
from labkit.wire import entry

VIEWS = ("tabs", "grid")  # one page per rank (views.rank_pages)

if TYPE_CHECKING:
    from labkit.runs.rank_names import RankCompletion
    from labkit.session import Session
    from labkit.views.rank_variables import RankVariables


class LabWindow:
    """Mixed into ``Lab``: the ranks' namespaces and debuggers, seen from the notebook."""

    session: Session

    def run_cell(
        self, code: str, ranks=None, timeout: float | None = None, live: bool | None = None, show_values: bool = False,
        cell: int | None = None, instruments: bool = False, dashboard: bool = False, background: bool = False,
        view: str | None = None,
    ):
        """Run notebook code on the ranks (all, or ``ranks``); what they print and display is shown labelled by rank.

        Returns the repr of each rank's last expression (None where there is none); ``show_values`` also shows
        them as ``[rank r] Out: ...`` (in their richest form: a figure, a table), as ``%%lab`` does. What several
        ranks produced alike is shown once (``[ranks 0-3]``); ``view="tabs"`` or ``"grid"`` shows each rank's
        output on a page of its own instead. ``live`` forces (True) or avoids (False) the redrawn display.
        ``cell``: the execution count of the ``%%lab`` cell ``code`` is from (tracebacks name it).
        ``instruments``, ``dashboard``, ``background``: its loop is watched, as ``run_script``'s."""
        if view not in (None, *VIEWS):
            raise LabConfigError(f"view is one of {', '.join(VIEWS)} (or None), got {view!r}")
        if instruments or dashboard or background:
            if view is not None:
                raise LabConfigError("view shows a cell's output; a watched cell (instruments, dashboard, background) "
                                     "shows its report: give one or the other")
            from labkit.runs.script_run import run_cell

            return run_cell(self.session, code, cell, ranks, timeout, dashboard, background)
        # The ranks are named after the heal that comes first (it may renumber them).
        with iteration_stops(self.session):  # a Ctrl-C stops a DDP loop between two of its steps
            reports = self.session.execute(ranks, entry.run_cell, (code, cell, None), timeout, live=live,
                                           show_values=show_values, view=view,
                                           on_interrupt=partial(stop_before_iteration, self.session))
        return [reports[rank].get("display") for rank in sorted(reports)]

    def debug(self, rank: int | None = None, commands: Iterable[str] | None = None) -> None:
        """pdb on ``rank``'s last exception (default: the first rank that raised in the last failed work): ``p``,
        ``pp``, ``l``, ``w``, ``up``, ``down``, ``q``, read with ``input()``; ``commands``: these lines instead,
        each printed after its prompt (scripts, tests). ``breakpoint()`` in work on the ranks needs no call:
        the cell waiting for it serves the same prompt (see ``labkit.runs.debugging``)."""
        from labkit.runs.debugging import post_mortem

        post_mortem(self.session, rank, commands)

    def who(self, ranks=None, timeout: float | None = None) -> RankVariables:
        """The user variables of every rank (or ``ranks``), as one table: type, and for tensors shape, dtype,
        device (a DTensor's placement), for modules the parameter count; where ranks differ, a row per group
        of ranks and what differs. The lab's own names, modules and names starting with _ are left out.
        Asks idle ranks only (``LabBusy`` while a run holds them); one that does not answer within ``timeout``
        seconds (default 10) is named below the table. Returns a ``RankVariables``."""
        from labkit.runs.rank_names import WHO_TIMEOUT_SECONDS, who

        return who(self.session, ranks, WHO_TIMEOUT_SECONDS if timeout is None else timeout)

    def complete(self, code: str, cursor: int | None = None, ranks=None,
                 wait: float | None = None) -> list[RankCompletion]:
        """How ``code`` completes at ``cursor`` (default: its end) in a rank's namespace: rank 0's, or the first
        of ``ranks``. Each ``RankCompletion``'s text replaces ``code[start:end]``, as IPython's completions do.
        Waits ``wait`` seconds at most (default 0.3); [] when the rank does not answer by then, or a run holds
        the ranks. Tab in a ``%%lab`` cell asks this."""
        from labkit.runs.rank_names import COMPLETION_WAIT_SECONDS, complete

        return complete(self.session, code, len(code) if cursor is None else cursor, ranks,
                        COMPLETION_WAIT_SECONDS if wait is None else wait)
