"""``%lab auto``: every cell that follows runs on the ranks, as if it began with ``%%lab``.

IPython lets an extension rewrite a cell's lines before they run (``input_transformers_cleanup``,
which come before the cell-magic check): while the mode is on, a cell is given a first line
``%%lab --auto``, so it takes the very path a ``%%lab`` cell takes (the ranks' output, errors and
time limit alike). A cell whose first line is itself a magic (``%lab auto off``, ``%lab status``,
``%%time``, ...) or a shell command (``!ls``) runs in the notebook as usual, so the way back is always
open. Each cell that ran on the ranks this way says so in its first line of output, so a reader of
the saved notebook knows where every cell ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

AUTO_FLAG = "--auto"  # what the rewritten cell's %%lab line carries, so the magic can say where it ran


def on_the_ranks(lines: list[str]) -> bool:
    """Whether a cell of ``lines`` goes to the ranks in auto mode (blank and magic or shell cells do not)."""
    first = next((line.strip() for line in lines if line.strip()), "")
    return bool(first) and not first.startswith(("%", "!"))


class AutoMode:
    """Turns auto mode on and off in one IPython shell."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.on = False

    def _rewrite(self, lines: list[str]) -> list[str]:
        if not self.on or not on_the_ranks(lines):
            return lines
        return [f"%%lab {AUTO_FLAG}\n", *lines]

    def set(self, on: bool) -> None:
        transformers = self.shell.input_transformers_cleanup
        if on and self._rewrite not in transformers:
            transformers.append(self._rewrite)
        if not on and self._rewrite in transformers:
            transformers.remove(self._rewrite)
        self.on = on
