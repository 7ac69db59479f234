"""The live training dashboard: ipywidgets around the picture ``DashboardFigure`` draws.

A header (the run and its state, the Stop button, the smoothing window), a
status line (the newest line a rank printed: progress goes here, not into the
cell) and the picture. ``update`` moves new data into the figure and re-renders
it, at most ``max_rate`` times a second.

The dashboard is shown once: one display, which holds the live widget while
the run trains and is replaced by the final picture when it ends (a PNG at
twice the display resolution, so it stays sharp and an executed or exported
notebook keeps it without widgets). Nothing else is left in the cell.

Stragglers: the detector (``MetricsTable.flagged``) says who is slow now;
``FlagHistory`` remembers over which steps each rank was flagged, so a flag
that clears stays marked on the throughput panel.
"""

from __future__ import annotations

import base64
import html
import threading
import time

import ipywidgets as widgets
from IPython.display import display

from labkit.units import format_bytes
from labkit.views.dashboard_figure import (  # noqa: F401 - step_range and the constants are the dashboard's API
    DEFAULT_SMOOTHING,
    FIRST_STEPS,
    WINDOW_STEPS,
    DashboardFigure,
    step_range,
)
from labkit.views.metrics import MetricsTable
from labkit.views.rank_output import in_kernel


class FlagHistory:
    """Over which steps each rank was flagged as a straggler: [(rank, first step, last step)]."""

    def __init__(self) -> None:
        self.spans: list[list[int]] = []
        self._open: dict[int, list[int]] = {}  # rank -> its span still being flagged

    def record(self, flagged, step: int | None) -> None:
        """What the detector says at ``step``: extend or open the flagged ranks' spans, close the others'."""
        if step is None:
            return
        for rank in flagged:
            span = self._open.get(rank)
            if span is None:
                span = self._open[rank] = [rank, step, step]
                self.spans.append(span)
            span[2] = max(span[2], step)
        for rank in [rank for rank in self._open if rank not in flagged]:
            del self._open[rank]

    def as_tuples(self) -> list[tuple[int, int, int]]:
        return [(rank, first, last) for rank, first, last in self.spans]


class Dashboard:
    """Draws a ``MetricsTable``; the Stop button stops the run at a step boundary."""

    def __init__(self, table: MetricsTable, title: str, on_stop=None, max_rate: float = 3.0,
                 planned_steps: int | None = None, smoothing: int = DEFAULT_SMOOTHING, hint: str = "") -> None:
        """``on_stop``: what the Stop button calls (None: no button); ``hint``: a standing note on the status
        line (how to stop a run that has no button)."""
        self.table = table
        # A known length lets a short run be shown whole and a long one's axis end at its last step.
        self.planned_steps = planned_steps if planned_steps and planned_steps > 0 else None
        self.title = title
        self.min_interval = 1.0 / max_rate
        self.draws = 0
        self.render_seconds = 0.0
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self.failures: list[tuple] = []  # (ranks, step, what) marked on the axes
        self.flags = FlagHistory()
        self.progress = ""  # the newest line a rank printed
        self.hint = hint
        self.final_picture: bytes | None = None
        self.picture = DashboardFigure(table.ranks(), title, self.planned_steps, smoothing)
        self.figure = self.picture.figure
        width, height = self.picture.display_size
        self.header = widgets.HTML(value=f"<b>{html.escape(title)}</b>: starting")
        self.status_line = widgets.HTML(value=self._status_line(), layout=widgets.Layout(min_height="1.4em"))
        self.image = widgets.Image(format="jpeg", layout=widgets.Layout(width=f"{width}px", max_width="100%"))
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          tooltip="stop the run after the step it is in")
        self.stop_button.layout.display = "" if on_stop else "none"
        if on_stop:
            self.stop_button.on_click(lambda _: self._stop(on_stop))
        self.smoothing_box = widgets.BoundedIntText(value=smoothing, min=1, max=WINDOW_STEPS,
                                                    description="| throughput line: mean of",
                                                    layout=widgets.Layout(width="260px"),
                                                    style={"description_width": "initial"})
        self.smoothing_box.observe(lambda change: self.set_smoothing(change["new"]), names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.stop_button, self.header, self.smoothing_box, widgets.Label("steps")]),
            self.status_line,
            self.image,
        ])
        self._handle = None

    @property
    def smoothing(self) -> int:
        return self.picture.smoothing

    def set_smoothing(self, steps: int) -> None:
        """Average throughput over ``steps`` steps (the faint lines stay per step); redraws at once."""
        with self._lock:
            self.picture.set_smoothing(steps)
        if self.smoothing_box.value != self.picture.smoothing:
            self.smoothing_box.value = self.picture.smoothing
        if self.final_picture is None:
            self.update(force=True)

    def _stop(self, on_stop) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        on_stop()

    def show(self) -> None:
        """Display the widget, in one display the final picture will replace (in a notebook only)."""
        self.update(force=True)
        if not in_kernel():
            return  # a script or test: the picture is still drawn, into ``image``
        bundle = self.widget._repr_mimebundle_()
        # The text twin names the run only, so a saved notebook does not depend on timing.
        bundle["text/plain"] = self._plain_text()
        self._handle = display(bundle, raw=True, display_id=True)

    def _plain_text(self) -> str:
        return f"training dashboard: {self.title}"

    # -- drawing -----------------------------------------------------------------

    def set_progress(self, line: str) -> None:
        """The newest line a rank printed (``[rank 0] step 40/200 ...``), shown under the header."""
        if line and line != self.progress:
            self.progress = line
            self.status_line.value = self._status_line()

    def _status_line(self) -> str:
        parts = [f"<code>{html.escape(self.progress)}</code>"] if self.progress else []
        if self.hint:
            parts.append(f"<i>{html.escape(self.hint)}</i>")
        return " &middot; ".join(parts)

    def update(self, force: bool = False, status: str | None = None) -> bool:
        """Redraw if due (or ``force``); return whether it drew."""
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return False
        with self._lock:
            if self.final_picture is not None:
                return False  # the run is over: its picture is final
            self._last_draw = now
            began = time.perf_counter()
            flagged = self.table.flagged()  # derived once per redraw, for the picture and the header
            self.flags.record(flagged, self.table.latest_step)
            text = status or self._status(flagged)
            self.image.value = self.picture.render(self.table, set(flagged), self.flags.as_tuples())
            self.render_seconds += time.perf_counter() - began
            self.header.value = f"<b>{html.escape(self.title)}</b>: {self._status_html(flagged, text)}"
            self.draws += 1
        return True

    def _status(self, flagged: list[int]) -> str:
        step = self.table.latest_step
        if step is None:
            return "waiting for the first step"
        stragglers = f"; straggler: rank {', '.join(map(str, flagged))}" if flagged else ""
        held = self.table.largest_memory()
        memory = f", at most {format_bytes(held)} per rank" if held else ""
        return f"step {step + 1}, {self.table.total_throughput():,.0f} samples/s in total{memory}{stragglers}"

    @staticmethod
    def _status_html(flagged: list[int], text: str) -> str:
        head, marker, tail = text.partition("; straggler:")
        if not flagged or not marker:
            return html.escape(text)
        return f"{html.escape(head)}; <span style='color:#cc3311'>straggler:{html.escape(tail)}</span>"

    def mark_failure(self, ranks, step: int, what: str = "died") -> None:
        """A failure on the step axes: which ranks went, after which step (kept if the run heals)."""
        with self._lock:
            self.picture.mark_failure(ranks, step, what)
            self.failures.append((tuple(ranks), step, what))

    def finish(self, status: str) -> None:
        """Draw the last frame with every step, then put the final picture where the widget was."""
        self.update(force=True, status=status)
        self.stop_button.disabled = True
        self.stop_button.description = "Done"
        self.smoothing_box.disabled = True
        with self._lock:
            self.final_picture = self.picture.final_png(status)
        if self._handle is not None:
            width, height = self.picture.display_size
            picture = base64.b64encode(self.final_picture).decode("ascii")
            # Shown at the display size: the picture's extra dots make it sharp, not larger.
            self._handle.update({"image/png": picture, "text/plain": self._plain_text()},
                                metadata={"image/png": {"width": width, "height": height}}, raw=True)
            # Nothing shows the widgets any more: free their models in the browser.
            for widget in (self.widget, *self.widget.children, *self.widget.children[0].children):
                widget.close()
