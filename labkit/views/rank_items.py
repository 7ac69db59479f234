"""One rank's output as a sequence of items: printed lines, displays and the cell's value, in order.

A rank's stdout arrives as text and its displays as separate outputs (``rank.displays`` marks each
with the number of lines printed before it, and with what it was: a display, an update of one, or
``clear_output``). ``rank_items`` puts them back in one sequence, as the rank's own notebook would
have shown it: a display between the lines it came between, an update applied to the display it
updates, a clear removing what came before it (``wait=True``: only when the next output comes).
The items are plain values, so two ranks' outputs can be compared item by item (``rank_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARK = "labkit"  # the metadata key rank.displays marks outputs with (the ranks' module is not imported here)
PLAIN = "text/plain"


@dataclass(frozen=True)
class Shown:
    """One display: its MIME bundle and metadata (without the lab's mark)."""

    data: dict
    metadata: dict = field(default_factory=dict)

    @property
    def rich(self) -> bool:
        """Whether it has a form richer than text (an image, HTML, ...)."""
        return any(key != PLAIN for key in self.data)

    @property
    def text(self) -> str:
        return str(self.data.get(PLAIN, ""))


@dataclass(frozen=True)
class Value:
    """A cell's last value: its repr, and its richer forms when it has any."""

    text: str
    rich: dict | None = None


Item = str | Shown | Value  # a line printed (without its newline), a display, the cell's value


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the text ended with a newline: no partial line after it
    return lines


def rank_items(stdout: str, outputs: list[dict], value: Value | None = None) -> list[Item]:
    """The items of one rank, in the order the rank produced them (see the module's docstring)."""
    lines = _lines(stdout)
    items: list[Item] = []
    by_id: dict[str, int] = {}  # display_id -> index in items of the display it names
    pending_clear = False
    printed = 0

    def add(item: Item) -> None:
        nonlocal pending_clear
        if pending_clear:
            items.clear()
            by_id.clear()
            pending_clear = False
        items.append(item)

    for output in outputs:
        mark = (output.get("metadata") or {}).get(MARK) or {}
        # An output without a mark (sent from another thread, or by an older rank) stands after the text so far.
        upto = min(int(mark.get("line", len(lines))), len(lines))
        for line in lines[printed:upto]:
            add(line)
        printed = max(printed, upto)
        kind = mark.get("kind", "display")
        if kind == "clear":
            if mark.get("wait"):
                pending_clear = True
            else:
                items.clear()
                by_id.clear()
                pending_clear = False
            continue
        metadata = {key: val for key, val in (output.get("metadata") or {}).items() if key != MARK}
        shown = Shown(dict(output.get("data") or {}), metadata)
        display_id = mark.get("display_id")
        if kind == "update":
            if display_id in by_id:  # a display cleared away is not brought back by its update
                items[by_id[display_id]] = shown
            continue
        add(shown)
        if display_id:
            by_id[display_id] = len(items) - 1
    for line in lines[printed:]:
        add(line)
    if value is not None:
        add(value)
    return items


def item_text(item: Item) -> list[str]:
    """An item as lines of text (a display by its text form, a value as ``Out: ...``)."""
    if isinstance(item, str):
        return [item]
    if isinstance(item, Value):
        return _lines(f"Out: {item.text}") or ["Out: "]
    return _lines(item.text) or [""]
