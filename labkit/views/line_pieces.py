"""Lines a rank prints in pieces, put back together before they are labelled.

A terminal cannot redraw, so the ranks' output is printed line by line, each line
labelled ``[rank r]``. Text reaches the notebook in chunks as the ranks flush it:
``print("abc", end="", flush=True)`` and later ``print("def")`` arrive apart, and
labelling each chunk would show two lines where the program printed one. So the
unfinished end of each stream waits here for its newline (a carriage return ends
a line too, as a progress bar redrawing itself does), and is shown anyway:

- when the work ends (``rest``), so nothing printed is lost;
- when it has waited ``PIECE_SECONDS`` (``overdue``), so a line a program leaves
  open for long ("loading... " before a slow step) still shows while it works;
- when it grows past ``PIECE_CHARS``, so one endless line cannot hold memory.

A piece shown early is not shown again: what follows it starts a line of its own.

Runs in the notebook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

PIECE_SECONDS = 5.0
PIECE_CHARS = 64 * 1024


class LinePieces:
    """Complete lines of text that arrives in chunks, per stream (any hashable key, e.g. ``(rank, "stdout")``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pieces: dict[Hashable, str] = {}  # stream -> its unfinished last line
        self._since: dict[Hashable, float] = {}  # stream -> when its unfinished line began
        self._after_return: set[Hashable] = set()  # streams whose last chunk ended with "\r" (a "\r\n" may be split)

    def lines(self, stream: Hashable, text: str) -> list[str]:
        """The lines ``text`` completes on ``stream`` (with what waited before it); its unfinished end waits."""
        if stream in self._after_return and text.startswith("\n"):
            text = text[1:]  # the second half of a "\r\n" that arrived apart: not an empty line
        self._after_return.discard(stream)
        if not text:
            return []
        text = self._pieces.pop(stream, "") + text
        end = max(text.rfind("\n"), text.rfind("\r")) + 1
        complete, piece = text[:end], text[end:]
        if complete.endswith("\r"):
            self._after_return.add(stream)
        if len(piece) > PIECE_CHARS:
            complete, piece = text, ""
        if piece:
            self._pieces[stream] = piece
            self._since.setdefault(stream, self._clock())
        else:
            self._since.pop(stream, None)
        return complete.splitlines()

    def overdue(self) -> list[tuple[Hashable, str]]:
        """The unfinished lines that waited ``PIECE_SECONDS`` or more, taken out: (stream, text)."""
        now = self._clock()
        return [(stream, self._take(stream)) for stream, since in list(self._since.items())
                if now - since >= PIECE_SECONDS]

    def take(self, stream: Hashable) -> str:
        """``stream``'s unfinished line, taken out ('' when none): something else is shown after it."""
        return self._take(stream)

    def rest(self) -> list[tuple[Hashable, str]]:
        """Every unfinished line, taken out: the work ended."""
        return [(stream, self._take(stream)) for stream in list(self._pieces)]

    def _take(self, stream: Hashable) -> str:
        self._since.pop(stream, None)
        return self._pieces.pop(stream, "")
