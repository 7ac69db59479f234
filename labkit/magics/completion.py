"""Tab in a ``%%lab`` cell completes from the ranks' names: an IPython matcher over ``lab.complete``.

The cell's body runs on the ranks, so its names are theirs: the matcher sends the body and the cursor
to one rank (rank 0, or the first of the cell's ``--ranks``), whose IPython completer answers over its
namespace (``rank.names``), and adds what it offers to the notebook's own completions. A rank that does
not answer within 0.3 s, or ranks held by a run, add nothing: Tab never waits longer. With ``%lab auto``
on, every cell that is not a magic's counts as the ranks' code. A ``%%lab --site`` cell runs on a site's
ranks, which this does not ask.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from IPython.core.completer import CompletionContext, SimpleCompletion, SimpleMatcherResult, context_matcher

from labkit.magics.auto import on_the_ranks
from labkit.magics.commands import CELL
from labkit.magics.values import rank_list

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from labkit.lab import Lab
    from labkit.runs.rank_names import RankCompletion

MATCHER_ID = "labkit.ranks_matcher"


@dataclass(frozen=True)
class RanksCode:
    """The part of a cell the ranks run, the cursor in it, and the cell's ``--ranks`` / ``--site``."""

    code: str
    offset: int
    ranks: list[int] | None = None
    site: str | None = None


def ranks_code(full_text: str, cursor_line: int, cursor_position: int, auto: bool = False) -> RanksCode | None:
    """Where the cursor is in code the ranks run: a ``%%lab`` cell's body, or (``auto``) a whole cell that is not a
    magic's; None elsewhere (another cell, or the ``%%lab`` line itself)."""
    lines = full_text.split("\n")
    first = next((index for index, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    head = lines[first].strip()
    if head == CELL or head.startswith(CELL + " "):
        if cursor_line <= first:
            return None
        body = lines[first + 1:]
        ranks, site = _cell_options(head[len(CELL):])
        return RanksCode("\n".join(body), _offset(body, cursor_line - first - 1, cursor_position), ranks, site)
    if auto and on_the_ranks(lines):  # as %lab auto decides which cells go to the ranks
        return RanksCode(full_text, _offset(lines, cursor_line, cursor_position))
    return None


def _offset(lines: list[str], cursor_line: int, cursor_position: int) -> int:
    return sum(len(line) + 1 for line in lines[:cursor_line]) + cursor_position


def _cell_options(line: str) -> tuple[list[int] | None, str | None]:
    """``--ranks`` and ``--site`` of a ``%%lab`` line as far as they can be read (it may be half typed)."""
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    found: dict[str, str] = {}
    for index, word in enumerate(words):
        name, equals, value = word.partition("=")
        if name in ("--ranks", "--site"):
            given = value if equals else words[index + 1] if index + 1 < len(words) else ""
            found[name] = "" if given.startswith("--") else given  # the next option: no value yet
    ranks = None
    if "--ranks" in found:
        try:
            ranks = rank_list(found["--ranks"]) or None
        except argparse.ArgumentTypeError:  # the ranks are not written yet
            ranks = None
    return ranks, found.get("--site") or None


def matcher_result(completions: list[RankCompletion], code: str, offset: int) -> SimpleMatcherResult:
    """The completions as one IPython matcher result: those that replace the same fragment as the first (IPython
    takes one fragment a matcher), the fragment being the code from their start to the cursor."""
    if not completions:
        return SimpleMatcherResult(completions=[], suppress=False)
    start = completions[0].start
    same = [found for found in completions if found.start == start and found.end == offset]
    return SimpleMatcherResult(completions=[SimpleCompletion(found.text, type=found.type) for found in same],
                               matched_fragment=code[start:offset], suppress=False)


def rank_completions(lab: Lab | None, auto: bool, context: CompletionContext) -> SimpleMatcherResult:
    """What the ranks offer at ``context`` (nothing when no lab runs or the cursor is not in the ranks' code)."""
    where = ranks_code(context.full_text, context.cursor_line, context.cursor_position, auto)
    if lab is None or not lab.running or where is None or where.site is not None:
        return SimpleMatcherResult(completions=[], suppress=False)
    try:
        found = lab.complete(where.code, where.offset, ranks=where.ranks)
    except Exception:  # a half-typed --ranks naming no rank, a lab stopping: the notebook's own completions stand
        found = []
    return matcher_result(found, where.code, where.offset)


def add_rank_matcher(shell: InteractiveShell, magics: Any) -> Any:
    """Register the matcher on ``shell``'s completer; it reads ``magics.lab`` and ``magics.auto`` at each Tab.
    Returns it, for ``remove_rank_matcher``."""

    @context_matcher(identifier=MATCHER_ID)
    def ranks_matcher(context: CompletionContext) -> SimpleMatcherResult:
        return rank_completions(magics.lab, bool(getattr(magics, "auto", False)), context)

    completer = getattr(shell, "Completer", None)
    if completer is not None:
        completer.custom_matchers.append(ranks_matcher)
    return ranks_matcher


def remove_rank_matcher(shell: InteractiveShell, matcher: Any) -> None:
    completer = getattr(shell, "Completer", None)
    if completer is not None and matcher in completer.custom_matchers:
        completer.custom_matchers.remove(matcher)
