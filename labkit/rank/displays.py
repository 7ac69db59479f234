"""What user work displays on a rank, sent to the notebook as outputs it can place and show.

An engine is an IPython kernel: ``display(...)``, matplotlib's inline backend (``plt.show()``),
``clear_output`` and display handles all go through its display publisher, which sends them on
its IOPub channel with the request they belong to, where ipyparallel's client collects them. It
keeps only ``display_data`` though: updates of a display handle and ``clear_output`` are dropped.
So a hook on the publisher (ipykernel's own ``register_hook``, for the engine's main thread, where
user work runs) sends every one of them as ``display_data``, marked in its metadata under
``labkit`` with what it was and where it stands among the rank's printed lines:

- ``kind``: ``display``, ``update`` (of the display ``display_id``) or ``clear`` (``wait``: only when
  the next output comes, as Jupyter does);
- ``line``: how many lines the work had printed to stdout when it came (the publisher flushes
  the streams first, and ipyparallel's handling of ``\\r`` never removes a newline, so the notebook
  can put it back between the same lines);
- ``bytes``: its size. An output over ``MAX_OUTPUT_BYTES``, or past ``MAX_WORK_BYTES`` of what the
  piece of work has on show, is replaced by a note saying what was left out and why, before it is
  sent: a 200 MB image must not reach (and freeze) the browser. Past ``MAX_WORK_OUTPUTS`` displays
  on show, one note says so and the rest are not sent. ``clear_output`` takes what was on show away,
  so a loop that redraws its figure after each clear can run for as long as it likes.

At the end of each piece of work, figures the work drew but did not show are shown, as Jupyter's
inline backend does after a cell (``flush_figures``). A cell's last value is formatted by the
shell's own display formatter, so a figure, a DataFrame or an object with ``_repr_html_`` keeps
its richest form (``rich``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

MAX_OUTPUT_BYTES = 8 * 1024 * 1024  # one output: under the 10 MiB a Jupyter server's websocket takes at once
MAX_WORK_BYTES = 64 * 1024 * 1024  # what one piece of work has on show on one rank (a clear starts again)
MAX_WORK_OUTPUTS = 500  # displays on show at once from one rank: more would freeze the browser, not inform
MARK = "labkit"  # the metadata key of the mark
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
# Plain values have nothing richer than their repr: not worth asking every formatter.
_PLAIN_TYPES = (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset, range)


def bundle_bytes(data: dict) -> int:
    """The size of a MIME bundle as it travels (text as is, JSON values serialised)."""
    total = 0
    for value in data.values():
        if isinstance(value, (str, bytes)):
            total += len(value)
        else:
            try:
                total += len(json.dumps(value))
            except (TypeError, ValueError):
                total += len(repr(value))
    return total


def use_inline_backend() -> None:
    """Make matplotlib draw a rank's figures as the notebook's own kernel does: inline, as PNG outputs.

    A rank has no window, and an ``MPLBACKEND=Agg`` inherited from a cluster's environment would make
    ``plt.show()`` silently do nothing there. A cell may still choose another backend (``matplotlib.use``)."""
    os.environ["MPLBACKEND"] = INLINE_BACKEND  # read when matplotlib is first imported
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None and "inline" not in str(matplotlib.rcParams._get("backend")):
        matplotlib.use(INLINE_BACKEND)  # imported already with another backend: switch (no figure exists yet)


def size_text(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e5 else f"{count / 1e3:.1f} kB"


class RankDisplays:
    """The rank's display publisher, marked and bounded; its printed lines counted."""

    @classmethod
    def for_shell(cls, shell: Any) -> RankDisplays:
        """The shell's one ``RankDisplays``: made on first use (a second would mark and count everything twice)."""
        made = getattr(shell, "_labkit_displays", None)
        if made is None:
            made = cls(shell)
            try:
                shell._labkit_displays = made
            except AttributeError:  # a shell that takes no attributes (tests): one per runtime then
                pass
        return made

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.lines = 0  # newlines written to stdout by this process
        self._work_first_line = 0
        self._work_bytes = 0  # on show: since the work began, or since its last clear
        self._work_outputs = 0
        self._count_stdout_lines()
        use_inline_backend()
        publisher = getattr(shell, "display_pub", None)
        if publisher is not None and hasattr(publisher, "register_hook"):
            publisher.register_hook(self._mark)

    def _count_stdout_lines(self) -> None:
        stream = sys.stdout
        write = stream.write

        def counting_write(text):  # an instance attribute: print() and every writer find it first
            if isinstance(text, str):
                self.lines += text.count("\n")
            return write(text)

        try:
            stream.write = counting_write  # type: ignore[method-assign]
        except AttributeError:  # a stream that takes no attributes: displays then stand after all text
            pass

    # -- one piece of work ------------------------------------------------------

    def begin(self) -> None:
        self._work_first_line = self.lines
        self._work_bytes = self._work_outputs = 0

    def end(self) -> None:
        """Show what the work drew and did not show (matplotlib's inline backend), as after a Jupyter cell."""
        backend = sys.modules.get("matplotlib_inline.backend_inline")
        if backend is None or "matplotlib.pyplot" not in sys.modules:
            return
        import matplotlib

        if "inline" not in str(matplotlib.get_backend()):
            return
        try:
            backend.flush_figures()
        except Exception as error:  # noqa: BLE001 - a figure that cannot draw is told, the work stands
            print(f"labkit: a figure could not be drawn: {error!r}", file=sys.stderr)

    # -- the hook ---------------------------------------------------------------

    def _mark(self, msg: dict) -> dict | None:
        kind = {"display_data": "display", "update_display_data": "update", "clear_output": "clear"}.get(
            msg["header"]["msg_type"])
        content = msg["content"]
        if kind is None or MARK in (content.get("metadata") or {}):
            return msg
        mark: dict[str, Any] = {"kind": kind, "line": self.lines - self._work_first_line}
        if kind == "display":
            self._work_outputs += 1
            if self._work_outputs > MAX_WORK_OUTPUTS + 1:
                return None  # said once already: the message is not sent (ipykernel's hooks drop a None)
        if kind == "clear":
            mark["wait"] = bool(content.get("wait"))
            content = {"data": {"text/plain": ""}, "metadata": {}, "transient": {}}
            self._work_bytes = self._work_outputs = 0
        elif kind == "display" and self._work_outputs > MAX_WORK_OUTPUTS:
            content = {"data": {"text/plain": f"labkit: more than {MAX_WORK_OUTPUTS} displays on show from this rank: "
                                              "the rest of this cell's are not shown (clear_output between them "
                                              "keeps only the newest)"}, "metadata": {}, "transient": {}}
        else:
            mark["display_id"] = (content.get("transient") or {}).get("display_id")
            content = dict(content)
            content["data"] = self._bounded(content.get("data") or {}, mark)
        content["metadata"] = {**(content.get("metadata") or {}), MARK: mark}
        msg["content"] = content
        msg["header"]["msg_type"] = msg["msg_type"] = "display_data"  # the only kind ipyparallel keeps
        return msg

    def _bounded(self, data: dict, mark: dict) -> dict:
        size = bundle_bytes(data)
        mark["bytes"] = size
        reason = None
        if size > MAX_OUTPUT_BYTES:
            reason = f"over the {size_text(MAX_OUTPUT_BYTES)} one output may take"
        elif self._work_bytes + size > MAX_WORK_BYTES:
            reason = f"past the {size_text(MAX_WORK_BYTES)} a cell may display on one rank"
        if reason is None:
            self._work_bytes += size
            return data
        what = str(data.get("text/plain", "an output"))[:200]
        kinds = ", ".join(sorted(key for key in data if key != "text/plain")) or "text"
        mark["left_out"] = True
        return {"text/plain": f"labkit: {what} ({kinds}, {size_text(size)}) was not shown: {reason}. Save it to a "
                              "file on the rank, or display a smaller version (fewer points, a lower dpi)"}

    # -- a cell's last value ------------------------------------------------------

    def rich(self, value: Any) -> dict | None:
        """``value``'s richer forms than its repr (a MIME bundle without text/plain), bounded; None if none."""
        if value is None or isinstance(value, _PLAIN_TYPES):
            return None
        formatter = getattr(self.shell, "display_formatter", None)
        if formatter is None:
            return None
        try:
            data, _ = formatter.format(value, exclude=("text/plain",))
        except Exception:  # noqa: BLE001 - a broken _repr_*_ leaves the repr, as IPython would
            return None
        figures = sys.modules.get("matplotlib.figure")
        if figures is not None and isinstance(value, figures.Figure) and "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close(value)  # shown as the value: not again with the cell's figures
        if not data:
            return None
        return self._bounded(data, {})  # too large: the note saying so stands in its place
