"""What the ranks print and display, labelled by rank: live while they run, readable at the end.

ipyparallel collects each engine's stdout and stderr as they stream in, and its displays
(``rank.displays`` marks each with its place among the printed lines); the lab polls them while
it waits. In a notebook the live view is one display redrawn in place (text, and the ranks' plots
and tables in its HTML form); when the work ends it is emptied and the final output is written
once: what several ranks produced alike once, labelled ``[ranks 0-3]``, what differs per rank
(``rank_blocks``), each display as an ordinary output of the notebook (an image, HTML, ...) under
its label, so a saved notebook shows it without a kernel. ``view="tabs"`` or ``"grid"`` writes
one page per rank instead (``rank_pages``). Outside a kernel (scripts, tests, a terminal) lines
are printed as they arrive, displays by their text form, and nothing is repeated.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from labkit.views.line_pieces import LinePieces
from labkit.views.rank_blocks import blocks_text, group_blocks, rank_label
from labkit.views.rank_items import MARK, Item, Value, item_text, rank_items

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

REDRAW_SECONDS = 0.2
LIVE_HTML_BYTES = 16 * 1024 * 1024  # past this the live view is text only (it is sent again at every redraw)


def label_lines(rank: int, text: str, stream: str = "stdout") -> list[str]:
    """``[rank 3] line`` for every line of ``text`` (stderr lines say so)."""
    return [f"{rank_label([rank], stream)} {line}" for line in text.splitlines()]


class RankTexts:
    """The stdout/stderr text, displays and last value of every rank of one piece of work, as they grow."""

    def __init__(self, ranks) -> None:
        self.ranks = list(ranks)
        self.stdout = {rank: "" for rank in self.ranks}
        self.stderr = {rank: "" for rank in self.ranks}
        self.outputs: dict[int, list[dict]] = {rank: [] for rank in self.ranks}
        self.results: dict[int, str | None] = {rank: None for rank in self.ranks}
        self.rich: dict[int, dict | None] = {rank: None for rank in self.ranks}

    def update(self, rank: int, stdout: str, stderr: str, outputs: list[dict] | None = None) -> tuple[str, str]:
        """Record the full texts (and displays) so far; return the text that is new since the last update."""
        new_out = stdout[len(self.stdout[rank]) :] if stdout.startswith(self.stdout[rank]) else stdout
        new_err = stderr[len(self.stderr[rank]) :] if stderr.startswith(self.stderr[rank]) else stderr
        self.stdout[rank], self.stderr[rank] = stdout, stderr
        if outputs is not None:
            self.outputs[rank] = list(outputs)
        return new_out, new_err

    def set_result(self, rank: int, shown: str | None, rich: dict | None = None) -> None:
        """The value of a cell's last expression on ``rank`` (already a repr, and its richer forms), or None."""
        self.results[rank] = shown
        self.rich[rank] = rich

    def forget_results(self) -> None:
        self.results = {rank: None for rank in self.ranks}
        self.rich = {rank: None for rank in self.ranks}

    def items(self) -> dict[int, list[Item]]:
        """Each rank's stdout, displays and value as one sequence (``rank_items``)."""
        values = {rank: Value(shown, self.rich[rank]) for rank, shown in self.results.items() if shown is not None}
        return {rank: rank_items(self.stdout[rank], self.outputs[rank], values.get(rank)) for rank in self.ranks}

    def error_items(self) -> dict[int, list[Item]]:
        return {rank: rank_items(self.stderr[rank], []) for rank in self.ranks}

    def render(self) -> tuple[str, str]:
        """(stdout, stderr) of all ranks as labelled text, what ranks produced alike once."""
        return blocks_text(group_blocks(self.items())), blocks_text(group_blocks(self.error_items()), "stderr")


def in_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (where displays can be redrawn)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class LiveOutput:
    """Shows a ``RankTexts`` while work runs and writes it once, readable, when done."""

    def __init__(self, texts: RankTexts, live: bool | None = None, show_values: bool = True, silent: bool = False,
                 view: str | None = None) -> None:
        self.texts = texts
        self.show_values = show_values
        self.silent = silent  # collect only (work running in the background prints nowhere)
        self.view = view  # None, or one page per rank at the end: "tabs" or "grid" (views.rank_pages)
        self.in_kernel = in_kernel() if live is None else live
        self._handle: DisplayHandle | None = None
        self._last_draw = 0.0
        self._dirty = False
        self._note = ""  # one line under the output while work runs (a rank stuck in a collective)
        self._printed_outputs = {rank: 0 for rank in texts.ranks}  # outside a kernel: displays printed so far
        self._pieces = LinePieces()  # outside a kernel: lines printed in pieces, until they are whole

    def update(self, rank: int, stdout: str, stderr: str, outputs: list[dict] | None = None) -> None:
        seen = len(self.texts.outputs[rank])
        new_out, new_err = self.texts.update(rank, stdout, stderr, outputs)
        new_displays = len(self.texts.outputs[rank]) != seen
        if self.silent or not (new_out or new_err or new_displays):
            return
        if self.in_kernel:
            self._dirty = True
            self._redraw()
            return
        # A terminal cannot redraw: print complete lines as they come (a line printed in pieces once it
        # is whole, ``line_pieces``), a display by its text form.
        self._print_lines(rank, "stdout", self._pieces.lines((rank, "stdout"), new_out))
        displays = self.texts.outputs[rank][self._printed_outputs[rank]:]
        waiting = self._pieces.take((rank, "stdout")) if displays else ""
        if waiting:
            self._print_lines(rank, "stdout", [waiting])  # it was printed before them
        for output in displays:
            if ((output.get("metadata") or {}).get(MARK) or {}).get("kind", "display") == "display":
                self._print_lines(rank, "stdout", str((output.get("data") or {}).get("text/plain", "")).splitlines())
        self._printed_outputs[rank] = len(self.texts.outputs[rank])
        self._print_lines(rank, "stderr", self._pieces.lines((rank, "stderr"), new_err))

    def _print_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        for line in lines:
            print(f"{rank_label([rank], stream)} {line}", file=getattr(sys, stream), flush=True)

    def _print_pieces(self, pieces) -> None:
        """Print unfinished lines (``line_pieces``) as the lines they are so far."""
        for (rank, stream), piece in pieces:
            if piece:
                self._print_lines(rank, stream, [piece])

    def _redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_SECONDS:
            return
        from IPython.display import display

        blocks, errors = group_blocks(self.texts.items()), group_blocks(self.texts.error_items())
        out, err = blocks_text(blocks), blocks_text(errors, "stderr")
        bundle = {"text/plain": out + err + (f"labkit: {self._note}\n" if self._note else "")}
        if any(output for output in self.texts.outputs.values()):
            from labkit.views.rank_pages import blocks_html

            page = blocks_html(blocks, errors, self._note)
            if len(page) <= LIVE_HTML_BYTES:
                bundle["text/html"] = page
        if self._handle is None:
            # Created empty so a notebook's saved output does not depend on timing.
            self._handle = display({"text/plain": ""}, raw=True, display_id=True)
        self._handle.update(bundle, raw=True)
        self._last_draw = now
        self._dirty = False

    def note(self, text: str) -> None:
        """Show ``text`` as one line under the output, redrawn in place ('' removes it). A terminal
        cannot redraw: it gets the line once, when it appears."""
        if self.silent or text == self._note:
            return
        appeared = text and not self._note
        self._note = text
        if self.in_kernel:
            self._dirty = True
            self._redraw()
        elif appeared:
            print(f"labkit: {text}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        """Called while waiting: draw pending text once the redraw interval passed."""
        if self.in_kernel and self._dirty:
            self._redraw()
        elif not self.in_kernel and not self.silent:
            self._print_pieces(self._pieces.overdue())

    def finish(self) -> None:
        """Empty the live view and write everything once (see the module's docstring)."""
        if self.silent:
            return
        if not self.show_values:
            self.texts.forget_results()
        self._note = ""  # the work ended: nothing waits any more
        if not self.in_kernel:
            # Lines were printed as they came; only lines left unfinished and the cells' last values remain.
            self._print_pieces(self._pieces.rest())
            values: dict[int, list[Item]] = {rank: [Value(text)] for rank, text in self.texts.results.items()
                                             if text is not None}
            _write(sys.stdout, blocks_text(group_blocks(values)))
            return
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
        if self.view is not None:
            self._write_pages()
            return
        _publish_blocks(group_blocks(self.texts.items()))
        _write(sys.stderr, blocks_text(group_blocks(self.texts.error_items()), "stderr"))

    def _write_pages(self) -> None:
        from IPython.display import publish_display_data

        from labkit.views.rank_pages import ranks_view_html

        items = self.texts.items()
        errors = {rank: [line for item in run for line in item_text(item)]
                  for rank, run in self.texts.error_items().items()}
        if not any(items.values()) and not any(errors.values()):
            return
        out, err = self.texts.render()
        publish_display_data({"text/plain": out + err, "text/html": ranks_view_html(items, errors, str(self.view))})


def _write(stream, text: str) -> None:
    if text:
        stream.write(text)
        stream.flush()


def _publish_blocks(blocks) -> None:
    """Write blocks as notebook outputs: labelled lines as stdout, each rich display as an output of its own."""
    from IPython.display import publish_display_data

    from labkit.views.rank_items import Shown

    lines: list[str] = []
    for ranks, run in blocks:
        label = rank_label(ranks)
        for item in run:
            rich = item.rich if isinstance(item, Value) else (
                item.data if isinstance(item, Shown) and item.rich else None)
            if rich is None:
                lines.extend(f"{label} {line}" for line in item_text(item))
                continue
            # The label (and a value's Out: line) stands above the output it names.
            if isinstance(item, Value):
                lines.extend(f"{label} {line}" for line in item_text(item))
            else:
                lines.append(label)
            _write(sys.stdout, "\n".join(lines) + "\n")
            lines.clear()
            bundle = {"text/plain": item.text, **rich} if isinstance(item, Value) else rich
            publish_display_data(bundle, item.metadata if isinstance(item, Shown) else {})
    _write(sys.stdout, "\n".join(lines) + ("\n" if lines else ""))
