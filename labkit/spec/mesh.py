"""Device mesh specs: validated before any collective runs, and drawn as a grid.

A mesh names the axes along which the ranks are laid out, e.g. ``dp=2 tp=2`` for
four ranks: the ranks fill the grid in row-major order, exactly as
``torch.distributed.device_mesh.init_device_mesh`` lays them out
(``arange(world).view(shape)``), so coordinates computed here are the ones the
ranks report. Everything in this module is pure: no processes, no torch.
"""

from __future__ import annotations

import html
import itertools
import math
import re
from dataclasses import dataclass

from labkit.spec.errors import LabConfigError

_AXIS_PATTERN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*$")
# Background colours for groups in the HTML picture (colour-blind safe palette).
_PALETTE = ("#cfe2f3", "#fce5cd", "#d9ead3", "#ead1dc", "#fff2cc", "#d0e0e3", "#f4cccc", "#d9d2e9")


class MeshError(LabConfigError):
    """A mesh spec that cannot be built on this lab's ranks."""


@dataclass(frozen=True)
class MeshSpec:
    """Named axes and their sizes; the product equals the world size."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    # -- construction and validation -----------------------------------------

    @classmethod
    def from_axes(cls, axes, world_size: int) -> "MeshSpec":
        """Validate ``{name: size}`` (or pairs) against ``world_size``; one size may be -1."""
        pairs = list(axes.items()) if isinstance(axes, dict) else list(axes)
        if not pairs:
            raise MeshError(f"a mesh needs at least one named axis, e.g. dp={world_size}")
        names, sizes = [], []
        for name, size in pairs:
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"axis name {name!r} is not a valid name: use letters, digits and _, e.g. dp, tp, pp")
            if name in names:
                raise MeshError(f"axis {name!r} appears twice: every axis needs its own name")
            if isinstance(size, bool) or not isinstance(size, int):
                raise MeshError(f"axis {name}: size must be an integer, got {size!r}")
            if size == 0 or size < -1:
                raise MeshError(f"axis {name}: size must be a positive integer (or -1 to infer it), got {size}")
            names.append(name)
            sizes.append(size)
        inferred = [name for name, size in zip(names, sizes) if size == -1]
        if len(inferred) > 1:
            raise MeshError(f"only one axis may be -1 (inferred), got {', '.join(inferred)}")
        known = math.prod(size for size in sizes if size != -1)
        if inferred:
            if world_size % known:
                raise MeshError(
                    f"cannot infer {inferred[0]}: the other axes multiply to {known}, "
                    f"which does not divide the world size {world_size}"
                )
            sizes = [world_size // known if size == -1 else size for size in sizes]
        elif known != world_size:
            shape = " x ".join(f"{name}={size}" for name, size in zip(names, sizes))
            raise MeshError(
                f"mesh {shape} holds {known} ranks but the lab has {world_size}: "
                f"the sizes must multiply to {world_size} (one axis may be -1 to infer it)"
            )
        return cls(tuple(names), tuple(sizes))

    @classmethod
    def parse(cls, text: str, world_size: int) -> "MeshSpec":
        """Parse ``"dp=2 tp=2"`` (spaces or commas between axes)."""
        words = [word for word in re.split(r"[\s,]+", text.strip()) if word]
        if not words:
            raise MeshError(f"give the mesh axes as name=size, e.g. %lab mesh dp={world_size}")
        pairs = []
        for word in words:
            match = _AXIS_PATTERN.match(word)
            if not match:
                raise MeshError(f"cannot read {word!r}: write each axis as name=size, e.g. dp=2 tp=2")
            pairs.append((match.group(1), int(match.group(2))))
        return cls.from_axes(pairs, world_size)

    # -- geometry -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The rank's index along every axis (row-major, last axis fastest)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        coordinate = []
        for size in reversed(self.shape):
            coordinate.append(rank % size)
            rank //= size
        return tuple(reversed(coordinate))

    def rank_at(self, coordinate) -> int:
        rank = 0
        for index, size in zip(coordinate, self.shape):
            rank = rank * size + index
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """The sets of ranks that talk along ``axis``: all other coordinates fixed."""
        if axis not in self.names:
            raise MeshError(f"no axis {axis!r} in this mesh; its axes are {', '.join(self.names)}")
        position = self.names.index(axis)
        others = [range(size) for index, size in enumerate(self.shape) if index != position]
        groups = []
        for fixed in itertools.product(*others):
            group = []
            for step in range(self.shape[position]):
                coordinate = list(fixed)
                coordinate.insert(position, step)
                group.append(self.rank_at(coordinate))
            groups.append(group)
        return sorted(groups)

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in zip(self.names, self.shape))

    # -- pictures -----------------------------------------------------------

    def _pages(self):
        """Split the mesh into 2-D pages: leading axes index pages, the last two form a grid."""
        lead = len(self.shape) - 2 if len(self.shape) > 2 else 0
        for page in itertools.product(*(range(size) for size in self.shape[:lead])):
            title = ", ".join(f"{name}={index}" for name, index in zip(self.names[:lead], page))
            yield title, page

    def _grid(self, page):
        """(row label, [(column label, rank)]) rows of one page."""
        if len(self.shape) == 1:
            return [("", [(f"{self.names[0]}={i}", i) for i in range(self.shape[0])])]
        row_name, column_name = self.names[-2], self.names[-1]
        rows = []
        for row in range(self.shape[-2]):
            cells = [
                (f"{column_name}={column}", self.rank_at((*page, row, column)))
                for column in range(self.shape[-1])
            ]
            rows.append((f"{row_name}={row}", cells))
        return rows

    def __str__(self) -> str:
        lines = [f"mesh {self.describe()} ({self.world_size} ranks)"]
        for title, page in self._pages():
            if title:
                lines.append(f"[{title}]")
            rows = self._grid(page)
            row_width = max(len(label) for label, _ in rows)
            cell_width = max(len(f"rank {self.world_size - 1}"), *(len(c) for c, _ in rows[0][1]))
            header = " " * row_width + "  " + "  ".join(label.ljust(cell_width) for label, _ in rows[0][1])
            lines.append(header.rstrip())
            for label, cells in rows:
                body = "  ".join(f"rank {rank}".ljust(cell_width) for _, rank in cells)
                lines.append(f"{label.ljust(row_width)}  {body}".rstrip())
        for name in self.names:
            groups = " ".join(str(group) for group in self.groups(name))
            lines.append(f"groups along {name}: {groups}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        # Colour every cell by its group along the last axis, so one row of
        # colour is one group of the innermost (fastest) axis.
        colour_of = {}
        for index, group in enumerate(self.groups(self.names[-1])):
            for rank in group:
                colour_of[rank] = _PALETTE[index % len(_PALETTE)]
        parts = [
            "<div style='font-family:monospace'>",
            f"<b>mesh {html.escape(self.describe())}</b> ({self.world_size} ranks)",
        ]
        for title, page in self._pages():
            rows = self._grid(page)
            parts.append("<table style='border-collapse:collapse;margin:4px 0'>")
            if title:
                parts.append(f"<caption style='text-align:left'>{html.escape(title)}</caption>")
            parts.append("<tr><th></th>" + "".join(f"<th>{html.escape(c)}</th>" for c, _ in rows[0][1]) + "</tr>")
            for label, cells in rows:
                row_html = "".join(
                    f"<td style='border:1px solid #888;padding:4px 10px;background:{colour_of[rank]}'>"
                    f"rank {rank}<br><small>{html.escape(str(self.coordinate(rank)))}</small></td>"
                    for _, rank in cells
                )
                parts.append(f"<tr><th>{html.escape(label)}</th>{row_html}</tr>")
            parts.append("</table>")
        for name in self.names:
            groups = " ".join(html.escape(str(group)) for group in self.groups(name))
            parts.append(f"<div>groups along <b>{html.escape(name)}</b>: {groups}</div>")
        parts.append("</div>")
        return "".join(parts)
