"""What the ranks print, labelled by rank: live while they run, in rank order at the end.

ipyparallel collects each engine's stdout and stderr as they stream in; the lab
polls those texts while it waits. In a notebook the live view is one display
that is redrawn in place (rank order, newest text), and when the work ends it is
emptied and the final text is printed once, in rank order, so that a saved
notebook reads 0, 1, 2, ... whatever the arrival order was. Outside a kernel
(scripts, tests) lines are printed as they arrive and nothing is repeated.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

REDRAW_SECONDS = 0.2


def label_lines(rank: int, text: str, stream: str = "stdout") -> list[str]:
    """``[rank 3] line`` for every line of ``text`` (stderr lines say so)."""
    tag = f"[rank {rank}]" if stream == "stdout" else f"[rank {rank}:{stream}]"
    return [f"{tag} {line}" for line in text.splitlines()]


class RankTexts:
    """The stdout/stderr text of every rank of one piece of work, as it grows."""

    def __init__(self, ranks) -> None:
        self.ranks = list(ranks)
        self.stdout = {rank: "" for rank in self.ranks}
        self.stderr = {rank: "" for rank in self.ranks}
        self.results: dict[int, str | None] = {rank: None for rank in self.ranks}

    def update(self, rank: int, stdout: str, stderr: str) -> tuple[str, str]:
        """Record the full texts so far; return what is new since the last update."""
        new_out = stdout[len(self.stdout[rank]) :] if stdout.startswith(self.stdout[rank]) else stdout
        new_err = stderr[len(self.stderr[rank]) :] if stderr.startswith(self.stderr[rank]) else stderr
        self.stdout[rank], self.stderr[rank] = stdout, stderr
        return new_out, new_err

    def set_result(self, rank: int, shown: str | None) -> None:
        """The value of a cell's last expression on ``rank`` (already a repr), or None."""
        self.results[rank] = shown

    def forget_results(self) -> None:
        self.results = {rank: None for rank in self.ranks}

    def render(self) -> tuple[str, str]:
        """(stdout, stderr) of all ranks, in rank order, every line labelled."""
        out, err = [], []
        for rank in self.ranks:
            out += label_lines(rank, self.stdout[rank])
            if self.results[rank] is not None:
                out += label_lines(rank, f"Out: {self.results[rank]}")
            err += label_lines(rank, self.stderr[rank], "stderr")
        return "\n".join(out) + ("\n" if out else ""), "\n".join(err) + ("\n" if err else "")


def in_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (where displays can be redrawn)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class LiveOutput:
    """Shows a ``RankTexts`` while work runs and prints it in rank order when done."""

    def __init__(self, texts: RankTexts, live: bool | None = None, show_values: bool = True, silent: bool = False) -> None:
        self.texts = texts
        self.show_values = show_values
        self.silent = silent  # collect only (work running in the background prints nowhere)
        self.in_kernel = in_kernel() if live is None else live
        self._handle: DisplayHandle | None = None
        self._last_draw = 0.0
        self._dirty = False
        self._note = ""  # one line under the output while work runs (a rank stuck in a collective)

    def update(self, rank: int, stdout: str, stderr: str) -> None:
        new_out, new_err = self.texts.update(rank, stdout, stderr)
        if self.silent or not (new_out or new_err):
            return
        if self.in_kernel:
            self._dirty = True
            self._redraw()
        else:
            # A terminal cannot redraw: print complete lines as they come.
            for line in label_lines(rank, new_out):
                print(line, file=sys.stdout, flush=True)
            for line in label_lines(rank, new_err, "stderr"):
                print(line, file=sys.stderr, flush=True)

    def _redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_SECONDS:
            return
        from IPython.display import display

        out, err = self.texts.render()
        text = out + err + (f"labkit: {self._note}\n" if self._note else "")
        if self._handle is None:
            # Created empty so a notebook's saved output does not depend on timing.
            self._handle = display({"text/plain": ""}, raw=True, display_id=True)
        self._handle.update({"text/plain": text}, raw=True)
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

    def finish(self) -> None:
        """Empty the live view and print everything once, in rank order."""
        if self.silent:
            return
        if not self.show_values:
            self.texts.forget_results()
        self._note = ""  # the work ended: nothing waits any more
        if self.in_kernel:
            if self._handle is not None:
                self._handle.update({"text/plain": ""}, raw=True)
            out, err = self.texts.render()
        else:
            # Lines were printed as they came; only the cells' last values remain.
            out = "\n".join(
                line
                for rank in self.texts.ranks
                if self.texts.results[rank] is not None
                for line in label_lines(rank, f"Out: {self.texts.results[rank]}")
            )
            out, err = (out + "\n" if out else ""), ""
        if out:
            sys.stdout.write(out)
            sys.stdout.flush()
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()
