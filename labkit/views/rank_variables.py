"""``RankVariables``: the ranks' variables as one table (what ``lab.who`` and ``%lab who`` show).

One row per variable where every rank asked holds the same kind of thing; where they differ
(a name some ranks lack, another type, shape, dtype, device, placement, size or value), one row
per group of ranks that agree, and the first of them says what differs. Tensor values are
never compared. Pure: built from what the ranks sent (``wire.schema.VariableInfo``).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from labkit.spec.errors import format_ranks
from labkit.wire.schema import VariableInfo

COLUMNS = ("name", "ranks", "type", "what", "differs")
# What tells variables of one name apart across ranks, in the words the table uses.
COMPARED = ("type", "shape", "dtype", "device", "placement", "parameters", "length", "value")


def describe(info: VariableInfo) -> str:
    """``(4, 8) float32 cpu`` / ``1,056 parameters`` / ``3 items`` / ``0.001``: the table's "what"."""
    if "shape" in info:
        words = [str(tuple(info["shape"])), info.get("dtype", ""), info.get("device", "")]
        text = " ".join(word for word in words if word)
        return f"{text}, {info['placement']}" if "placement" in info else text
    if "parameters" in info:
        return f"{info['parameters']:,} parameters"
    if "length" in info:
        return f"{info['length']} item{'' if info['length'] == 1 else 's'}"
    return info.get("value", "")


def what_differs(held: dict[int, VariableInfo], asked: list[int]) -> str:
    """Where one name differs across the ranks ``asked`` (``held``: the ranks that have it), in words;
    "" where it is the same everywhere."""
    said = []
    if set(held) != set(asked):
        said.append(f"only on {format_ranks(held)}")
    infos = list(held.values())
    said += [key for key in COMPARED if len({repr(info.get(key)) for info in infos}) > 1]
    return ", ".join(said)


def rank_span(ranks: list[int], asked: list[int]) -> str:
    return "all" if ranks == asked and len(asked) > 1 else ", ".join(map(str, ranks))


@dataclass(frozen=True)
class RankVariables:
    """The user variables of some ranks. ``ranks``: rank -> name -> ``VariableInfo``, for each rank that
    answered; ``missing``: rank -> why it is not in the table (it froze, died, did not answer in time)."""

    ranks: dict[int, dict[str, VariableInfo]]
    missing: dict[int, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every name, on any rank, in order (``Box`` beside ``box``)."""
        return sorted({name for variables in self.ranks.values() for name in variables},
                      key=lambda name: (name.lower(), name))

    def on_ranks(self, name: str) -> dict[int, VariableInfo]:
        """``name`` on each rank that holds it."""
        return {rank: variables[name] for rank, variables in sorted(self.ranks.items()) if name in variables}

    @property
    def differences(self) -> dict[str, str]:
        """name -> what differs across the ranks (``what_differs``), for the names that differ."""
        asked = sorted(self.ranks)
        found = {name: what_differs(self.on_ranks(name), asked) for name in self.names}
        return {name: said for name, said in found.items() if said}

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """The table's rows (``COLUMNS``): one per name, or one per group of ranks that agree on it."""
        asked = sorted(self.ranks)
        rows = []
        for name in self.names:
            held = self.on_ranks(name)
            groups: dict[tuple[str, str], list[int]] = {}
            for rank, info in held.items():
                groups.setdefault((info["type"], describe(info)), []).append(rank)
            differs = what_differs(held, asked)
            for index, ((kind, what), ranks) in enumerate(groups.items()):
                rows.append((name if index == 0 else "", rank_span(ranks, asked), kind, what,
                             differs if index == 0 else ""))
        return rows

    def headline(self) -> str:
        asked = sorted(self.ranks)
        if not asked:
            return "no rank answered"
        differing = len(self.differences)
        count = len(self.names)
        where = format_ranks(asked)
        if not count:
            return f"no variables on {where}"
        return (f"{count} variable{'s' if count != 1 else ''} on {where}"
                + (f"; {differing} differ{'s' if differing == 1 else ''} across ranks" if differing else ""))

    def notes(self) -> list[str]:
        return [f"rank {rank} is left out: it {why}" for rank, why in sorted(self.missing.items())]

    def __str__(self) -> str:
        rows = self.rows()
        lines = [self.headline()]
        if rows:
            widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(COLUMNS)]
            for cells in (COLUMNS, *rows):
                lines.append("  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip())
        return "\n".join(lines + self.notes())

    __repr__ = __str__

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{column}</th>" for column in COLUMNS)
        body, differs = "", False
        for cells in self.rows():
            differs = bool(cells[4]) if cells[0] else differs  # a name's later rows are its other ranks
            colour = "#fff2cc" if differs else "white"
            body += "<tr>" + "".join(f"<td style='padding:2px 8px;background:{colour}'>{html.escape(cell)}</td>"
                                     for cell in cells) + "</tr>"
        table = f"<table><tr>{head}</tr>{body}</table>" if body else ""
        notes = "".join(f"<div>{html.escape(line)}</div>" for line in self.notes())
        return f"<div><b>{html.escape(self.headline())}</b>{table}{notes}</div>"
