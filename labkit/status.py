"""A snapshot of a lab, drawn as a table: one row per rank."""

from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass(frozen=True)
class RankStatus:
    rank: int
    engine: int | None
    pid: int | None
    state: str  # ready | busy | dead | no group
    device: str
    threads: int | None
    generation: int | None
    coordinate: tuple[int, ...] | None


@dataclass(frozen=True)
class LabStatus:
    plan: str
    running: bool
    generation: int = 0
    mesh: str | None = None
    timeout: float | None = None
    ranks: tuple[RankStatus, ...] = ()

    _COLUMNS = ("rank", "state", "pid", "engine", "device", "threads", "group", "coordinate")

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for row in self.ranks:
            rows.append(
                (
                    str(row.rank),
                    row.state,
                    "-" if row.pid is None else str(row.pid),
                    "-" if row.engine is None else str(row.engine),
                    row.device,
                    "-" if row.threads is None else str(row.threads),
                    "-" if row.generation is None else str(row.generation),
                    "-" if row.coordinate is None else str(row.coordinate),
                )
            )
        return rows

    def headline(self) -> str:
        if not self.running:
            return f"lab stopped ({self.plan})"
        mesh = f"mesh {self.mesh}" if self.mesh else "no mesh"
        ready = sum(row.state == "ready" for row in self.ranks)
        return (
            f"lab running: {self.plan}; {ready}/{len(self.ranks)} ranks ready; "
            f"process group generation {self.generation}; {mesh}; cell timeout {self.timeout:g} s"
        )

    @property
    def healthy(self) -> bool:
        return self.running and all(row.state == "ready" for row in self.ranks)

    def __str__(self) -> str:
        lines = [self.headline()]
        rows = self._rows()
        if rows:
            widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(self._COLUMNS)]
            lines.append("  ".join(column.ljust(width) for column, width in zip(self._COLUMNS, widths)).rstrip())
            for row in rows:
                lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        colour = {"ready": "#d9ead3", "busy": "#fff2cc", "dead": "#f4cccc", "no group": "#fce5cd"}
        head = "".join(f"<th>{column}</th>" for column in self._COLUMNS)
        body = "".join(
            "<tr>"
            + "".join(
                f"<td style='padding:2px 8px;background:{colour.get(cells[1], 'white') if index == 1 else 'white'}'>"
                f"{html.escape(cell)}</td>"
                for index, cell in enumerate(cells)
            )
            + "</tr>"
            for cells in self._rows()
        )
        table = f"<table><tr>{head}</tr>{body}</table>" if body else ""
        return f"<div><b>{html.escape(self.headline())}</b>{table}</div>"
