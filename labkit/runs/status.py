"""A snapshot of a lab, drawn as a table: one row per rank."""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit.runs.deadlock import describe_whereabouts
from labkit.wire import entry

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session


@dataclass(frozen=True)
class RankStatus:
    rank: int
    engine: int | None
    pid: int | None
    host: str | None
    state: str  # ready | busy | dead | frozen | lost | no group | training
    device: str
    threads: int | None
    generation: int | None
    coordinate: tuple[int, ...] | None
    doing: str | None = None  # a busy rank: its line in the cell, and the collective it waits in


@dataclass(frozen=True)
class LabStatus:
    plan: str
    running: bool
    generation: int = 0
    mesh: str | None = None
    timeout: float | None = None
    ranks: tuple[RankStatus, ...] = ()
    training: str | None = None
    link: str | None = None  # the simulated slow link (lab.link), in words

    _COLUMNS = ("rank", "state", "host", "pid", "engine", "device", "threads", "group", "coordinate")

    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for row in self.ranks:
            rows.append(
                (
                    str(row.rank),
                    row.state,
                    row.host or "-",
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
        if self.link:
            mesh += f"; simulated link {self.link}"
        if self.training:
            return f"lab running: {self.plan}; training in the background ({self.training}); {mesh}"
        ready = sum(row.state == "ready" for row in self.ranks)
        broken = [row.rank for row in self.ranks if row.state in ("dead", "frozen", "lost")]
        repair = f"; the next call replaces rank{'s' if len(broken) > 1 else ''} {', '.join(map(str, broken))}" \
            if broken else ""
        return (
            f"lab running: {self.plan}; {ready}/{len(self.ranks)} ranks ready{repair}; "
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
        lines += self.doing_lines()
        return "\n".join(lines)

    def doing_lines(self) -> list[str]:
        """'rank 1 is at line 4 (`dist.all_reduce(x)`), waiting in ...' for each busy rank that says."""
        return [f"rank {row.rank} is {row.doing}" for row in self.ranks if row.doing]

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        colour = {"ready": "#d9ead3", "busy": "#fff2cc", "dead": "#f4cccc", "frozen": "#f4cccc", "lost": "#f4cccc",
                  "no group": "#fce5cd", "training": "#cfe2f3"}
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
        doing = "".join(f"<div>{html.escape(line)}</div>" for line in self.doing_lines())
        return f"<div><b>{html.escape(self.headline())}</b>{table}{doing}</div>"


def collect_status(session: Session, timeout: float) -> LabStatus:
    """Ask every idle rank who it is (bounded by ``timeout``); while a run trains, ask nobody.

    Ranks busy with a cell (or ``lab.run``) would answer only when it ends: they are not asked, and
    show where they are instead, as the cell's work reads it (``RankWork.whereabouts``)."""
    if session.cluster is None:
        return LabStatus(session.plan.describe(), running=False)
    cluster = session.cluster
    training = session.busy_with
    work = session.foreground
    busy = set(work.pending) if work is not None else set()
    whereabouts = work.whereabouts if work is not None else {}
    now = time.monotonic()
    # Only ranks that can answer are asked (a dropped engine cannot even be addressed).
    conditions = {rank: cluster.condition(rank) for rank in range(session.world_size)}
    pending = {} if training else {
        rank: cluster.engine(rank).apply_async(entry.identity)
        for rank in range(session.world_size) if conditions[rank] is None and rank not in busy
    }
    deadline = time.monotonic() + timeout
    rows = []
    for rank in range(session.world_size):
        condition = conditions[rank]
        info = None
        if rank in pending:
            try:
                info = pending[rank].get(max(0.0, deadline - time.monotonic()))
            except Exception:
                info = None
        if condition is not None:
            state = "frozen" if "frozen" in condition else "lost" if "dropped" in condition else "dead"
        elif training:
            state = "training"
        elif info is None:
            state = "busy"
        else:
            state = "ready" if info["group_ready"] else "no group"
        rows.append(
            RankStatus(
                rank=rank,
                engine=cluster.engine_of.get(rank),
                pid=cluster.pid_of.get(rank),
                host=cluster.records[rank].host if rank in cluster.records else None,
                state=state,
                device=info["device"] if info else "?",
                threads=info["threads"] if info else None,
                generation=info["generation"] if info else None,
                coordinate=session.mesh_spec.coordinate(rank) if session.mesh_spec else None,
                doing=describe_whereabouts(rank, whereabouts[rank], now) if state == "busy" and rank in whereabouts
                else None,
            )
        )
    plan = session.plan.describe()
    if session.world_size != session.plan.ranks:
        plan += f"; {session.world_size} ranks now, with the engines that joined"
    return LabStatus(
        plan,
        running=True,
        generation=session.generation,
        mesh=session.mesh_spec.describe() if session.mesh_spec else None,
        timeout=session.timeout,
        ranks=tuple(rows),
        training=training,
        link=session.link.describe() if session.link is not None else None,
    )
