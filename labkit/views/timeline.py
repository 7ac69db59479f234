"""Per-rank timelines of the last steps: a Gantt picture and a Chrome/Perfetto trace.

The input is each rank's list of step entries from ``StepRecorder.timeline``:
the step's span, the main thread's busy fraction between sampled moments, and
every collective from issue to completion. A span counts as compute when the
main thread was busy at least half of it, else as waiting (blocked, mostly on
communication; on an oversubscribed machine waiting for a core counts as busy).
Collectives are drawn in a lane under each rank's, so a collective that runs
while the rank computes, DDP's overlap, shows as a bar under compute, and a
pipeline's bubble as waiting at the start and end of a stage's step.
"""

from __future__ import annotations

import io
import json

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.wire.schema import TimelineStep

KIND_COLOURS = {
    "all_reduce": "#ee6677",
    "all_gather": "#228833",
    "reduce_scatter": "#ccbb44",
    "broadcast": "#66ccee",
    "send": "#aa3377",
    "recv": "#bb5566",
    "all_to_all": "#004488",
    "barrier": "#999999",
}
COMPUTE, WAITING = "#4477aa", "#dddddd"


def _last_steps(entries_by_rank: dict[int, list[TimelineStep]], steps: int | None) -> dict[int, list[TimelineStep]]:
    common = set.intersection(*(set(e["step"] for e in entries) for entries in entries_by_rank.values()))
    chosen = sorted(common)[-steps:] if steps else sorted(common)
    return {rank: [e for e in entries if e["step"] in chosen] for rank, entries in entries_by_rank.items()}


class Timeline:
    """A picture of the last steps on every rank; ``save`` it or ``export_trace`` it."""

    def __init__(self, entries_by_rank: dict[int, list[TimelineStep]], steps: int | None = None,
                 title: str = "") -> None:
        self.entries = _last_steps(entries_by_rank, steps)
        self.title = title
        starts = [e["start"] for entries in self.entries.values() for e in entries]
        self.origin = min(starts) if starts else 0.0

    def __repr__(self) -> str:
        steps = max((len(entries) for entries in self.entries.values()), default=0)
        return f"<Timeline: {steps} step(s) on {len(self.entries)} ranks; export_trace(path) writes it for Perfetto>"

    # -- picture ----------------------------------------------------------

    def figure(self) -> Figure:
        return self._canvas().figure

    def _canvas(self) -> FigureCanvasAgg:
        """The picture, drawn on a canvas of its own (the PNG is printed from it)."""
        ranks = sorted(self.entries)
        figure = Figure(figsize=(11, 0.8 + 0.75 * len(ranks)), dpi=80)
        canvas = FigureCanvasAgg(figure)
        axes = figure.subplots()
        kinds = set()
        ms = lambda t: (t - self.origin) * 1000  # noqa: E731 - a unit, read inline
        for lane, rank in enumerate(ranks):
            y = len(ranks) - 1 - lane
            work: dict[str, list[tuple[float, float]]] = {COMPUTE: [], WAITING: []}
            collectives: dict[str, list] = {}
            for entry in self.entries[rank]:
                for begin, end, busy in entry["busy"]:
                    work[COMPUTE if busy >= 0.5 else WAITING].append((ms(begin), (end - begin) * 1000))
                for kind, _, issued, completed in entry["collectives"]:
                    collectives.setdefault(kind, []).append((ms(issued), max(completed - issued, 1e-5) * 1000))
                axes.axvline(ms(entry["start"]), color="#555555", linewidth=0.4)
            for colour, spans in work.items():
                axes.broken_barh(spans, (y - 0.1, 0.45), facecolors=colour)
            for kind, spans in collectives.items():
                kinds.add(kind)
                axes.broken_barh(spans, (y - 0.38, 0.22), facecolors=KIND_COLOURS.get(kind, "#777777"))
        axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in reversed(ranks)])
        axes.set_xlabel("ms")
        shown = max((len(entries) for entries in self.entries.values()), default=0)
        which = "last step" if shown == 1 else f"last {shown} steps"
        axes.set_title(self.title or f"{which} per rank: compute, waiting, and collectives (lower lane)", fontsize=11)
        handles = [Patch(color=COMPUTE, label="compute"), Patch(color=WAITING, label="waiting")]
        handles += [Patch(color=KIND_COLOURS.get(kind, "#777777"), label=kind) for kind in sorted(kinds)]
        axes.legend(handles=handles, fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.25 / len(ranks) - 0.12),
                    ncol=len(handles), frameon=False)
        figure.subplots_adjust(bottom=0.1 + 0.25 / len(ranks) + 0.1, top=0.9, left=0.07, right=0.99)
        return canvas

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self._canvas().print_png(buffer)
        return buffer.getvalue()

    def save(self, path: str) -> None:
        self.figure().savefig(path)

    def waiting_fraction(self, rank: int) -> float:
        """Share of the shown steps' time this rank spent waiting (the pipeline bubble, say)."""
        total = waiting = 0.0
        for entry in self.entries[rank]:
            for begin, end, busy in entry["busy"]:
                total += end - begin
                waiting += (end - begin) * (1 - busy)
        return waiting / total if total else 0.0

    # -- trace --------------------------------------------------------------

    def chrome_trace(self) -> dict:
        """Trace Event Format: one process per rank, threads for work, steps and collectives."""
        events = []
        for rank in sorted(self.entries):
            events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}})
            for tid, name in ((0, "main thread"), (1, "steps"), (2, "collectives")):
                events.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": name}})
            for entry in self.entries[rank]:
                events.append(_complete(rank, 1, f"step {entry['step']}", entry["start"], entry["end"]))
                for begin, end, busy in entry["busy"]:
                    name = "compute" if busy >= 0.5 else "waiting"
                    events.append(_complete(rank, 0, name, begin, end, {"busy fraction": round(busy, 3)}))
                for index, (kind, nbytes, issued, completed) in enumerate(entry["collectives"]):
                    # Collectives overlap each other: async slices, one id each.
                    ident = f"{rank}-{entry['step']}-{index}"
                    events.append({"ph": "b", "cat": "collective", "name": kind, "id": ident, "pid": rank, "tid": 2,
                                   "ts": issued * 1e6, "args": {"bytes": nbytes}})
                    events.append({"ph": "e", "cat": "collective", "name": kind, "id": ident, "pid": rank, "tid": 2,
                                   "ts": completed * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_trace(self, path: str) -> str:
        """Write the Chrome trace JSON (open it in ui.perfetto.dev or chrome://tracing); return the path."""
        with open(path, "w") as handle:
            json.dump(self.chrome_trace(), handle)
        return path


def _complete(pid: int, tid: int, name: str, begin: float, end: float, args: dict | None = None) -> dict:
    event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": begin * 1e6, "dur": max(0.0, end - begin) * 1e6}
    if args:
        event["args"] = args
    return event
