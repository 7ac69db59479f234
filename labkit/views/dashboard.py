"""The live training dashboard: ipywidgets around a matplotlib figure, redrawn in place.

The figure is made once (Agg canvas, no pyplot, so any thread may draw it) with
four panels: throughput per rank and in total; each rank's step split into
compute and exposed communication, with the bytes it moved per step; communication
time and bytes by collective;
the loss. Injected slowdowns are marked on the time axes, flagged stragglers in
red. ``update`` only moves data into existing artists and re-renders the image, at
most ``max_rate`` times a second; the picture goes into an ``ipywidgets.Image``.

The step axis follows the run (``step_range``): it grows in doublings while the
run is young, then becomes a window of the last few hundred steps that moves
in half-window jumps, so the present always fills the plot and the
background is redrawn only at those jumps. Only the visible steps are drawn.

Live frames are JPEG (cheap to encode); when the run ends, ``finish`` writes
the last picture as PNG into a plain display output too, so an executed or
exported notebook keeps it without widgets.
"""

from __future__ import annotations

import base64
import bisect
import io
import threading
import time

import ipywidgets as widgets
from IPython.display import display
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from labkit.views.metrics import MetricsTable
from labkit.views.rank_output import in_kernel
from labkit.units import format_bytes

# The step axis never spans more than this many steps; it moves half of it at a time.
WINDOW_STEPS = 256
# A young run's axis starts this wide, so its first frames do not redraw the background each step.
FIRST_STEPS = 16

RANK_COLOURS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000")
COMPUTE, WAITING = "#4477aa", "#ee9944"


def _colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def _grow(value: float, factor: float) -> float:
    """The smallest power of ``factor`` at or above ``value``: a range that grows in steps."""
    limit = 1e-6
    while limit < value:
        limit *= factor
    return limit


def step_range(latest: int, planned_steps: int | None = None, window: int = WINDOW_STEPS) -> tuple[int, int]:
    """The step axis' (first, last) for a run whose newest step is ``latest``.

    A run planned to fit in one window shows its whole planned length from the
    start (the axes are drawn once). Otherwise, while the run fits in half a
    window the axis starts at 0 and doubles as the run outgrows it; later it
    shows ``window`` steps and jumps half a window forward whenever the newest
    step reaches the window's end, so the newest step stays in the right half
    and the axes (a full redraw, ~70 ms) are redrawn only at the jumps. A long
    run's axis stops at its planned end.
    """
    grown = FIRST_STEPS
    while grown < latest + 1:
        grown *= 2
    if planned_steps and planned_steps <= window:
        return 0, max(planned_steps, latest + 1)
    if latest + 1 <= window // 2:
        return 0, grown
    jump = window // 2
    first = max(0, (latest - window // 2) // jump * jump)
    last = first + window
    if planned_steps:
        last = max(min(last, planned_steps), latest + 1)
    return first, last


def _within(step_span: tuple[int, int], steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """The part of a step series (steps ascending) that falls on the visible axis."""
    start = bisect.bisect_left(steps, step_span[0])
    stop = bisect.bisect_right(steps, step_span[1])
    return steps[start:stop], values[start:stop]


def _encode(canvas, image_format: str) -> bytes:
    """The drawn canvas as JPEG (live frames: a third of PNG's encoding time) or PNG (the final picture)."""
    from PIL import Image as PILImage

    width, height = canvas.get_width_height()
    picture = PILImage.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buffer = io.BytesIO()
    if image_format == "JPEG":
        picture.convert("RGB").save(buffer, format="JPEG", quality=85)
    else:
        picture.convert("RGB").save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


class Dashboard:
    """Draws a ``MetricsTable``; shows a Stop button when the run can be stopped from here."""

    def __init__(self, table: MetricsTable, title: str, on_stop=None, max_rate: float = 3.0,
                 planned_steps: int | None = None) -> None:
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
        self.header = widgets.HTML(value=f"<b>{title}</b>: starting")
        self.image = widgets.Image(format="jpeg", layout=widgets.Layout(width="760px"))
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.layout.display = "" if on_stop else "none"
        if on_stop:
            self.stop_button.on_click(lambda _: self._stop(on_stop))
        self.widget = widgets.VBox([widgets.HBox([self.stop_button, self.header]), self.image])
        self._final = None
        self._build_figure()

    def _stop(self, on_stop) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        on_stop()

    def show(self) -> None:
        """Display the widget and an (empty) slot for the final picture (in a notebook only)."""
        self.update(force=True)
        if not in_kernel():
            return  # a script or test: the picture is still drawn, into ``image``
        display(self.widget)
        # Empty until the run ends, so a saved notebook does not depend on timing.
        self._final = display({"text/plain": ""}, raw=True, display_id=True)

    # -- the figure: artists made once, then only fed new data -------------

    def _build_figure(self) -> None:
        # Axes, ticks and labels are drawn only when a range grows; each frame
        # restores that background and draws just the data ("blitting"): text
        # is most of what matplotlib spends on a frame.
        self.figure = Figure(figsize=(10.5, 5.6), dpi=72)
        FigureCanvasAgg(self.figure)
        self.figure.subplots_adjust(left=0.07, right=0.98, top=0.94, bottom=0.09, hspace=0.45, wspace=0.22)
        axes = self.figure.subplots(2, 2)
        self._throughput, self._split, self._collectives, self._loss = axes.flat
        for ax in axes.flat:
            ax.tick_params(labelsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(5))
        ranks = self.table.ranks()
        self._rate_lines = {
            rank: self._throughput.plot([], [], color=_colour(rank), linewidth=1, label=f"rank {rank}", animated=True)[0]
            for rank in ranks
        }
        self._throughput.set_title("throughput per rank (samples/s)", fontsize=10)
        self._throughput.set_xlabel("step", fontsize=9)
        self._throughput.legend(handles=[Line2D([], [], color=_colour(r), label=f"rank {r}") for r in ranks],
                                fontsize=7, loc="lower left", ncol=min(4, max(1, len(ranks))))
        self._compute_bars = self._split.bar(ranks, [0] * len(ranks), color=COMPUTE, label="compute", animated=True)
        self._waiting_bars = self._split.bar(ranks, [0] * len(ranks), color=WAITING, label="exposed communication",
                                             animated=True)
        self._split.set_title("step time per rank, ms (recent mean)", fontsize=10)
        self._split.set_xticks(ranks)
        # Above the bars (the y range keeps room for it): part of the background, never redrawn.
        self._split.legend(
            handles=[Patch(color=COMPUTE, label="compute"), Patch(color=WAITING, label="exposed communication")],
            fontsize=7, loc="upper center", ncol=2, frameon=False)
        # Each rank's traffic per step, at the foot of its bar (a parameter server's stands out).
        self._traffic_labels = [
            self._split.text(rank, 0, "", ha="center", va="bottom", fontsize=7, color="white", animated=True)
            for rank in ranks
        ]
        self._straggler_marks = [
            self._split.text(rank, 0, "straggler", ha="center", va="bottom", fontsize=8, color="#cc3311",
                             animated=True, visible=False)
            for rank in ranks
        ]
        self._collectives.set_title("communication per step, all ranks (ms)", fontsize=10)
        self._kinds: tuple = ()
        self._kind_bars, self._kind_labels = [], []
        self._loss_line = self._loss.plot([], [], color="#222222", animated=True)[0]
        self._loss.set_title("loss", fontsize=10)
        self._loss.set_xlabel("step", fontsize=9)
        self._marked_events: set = set()
        self._limits = None
        self._background = None

    def update(self, force: bool = False, status: str | None = None) -> bool:
        """Redraw if due (or ``force``); return whether it drew."""
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return False
        with self._lock:
            self._last_draw = now
            began = time.perf_counter()
            flagged = self.table.flagged()  # derived once per redraw, for the picture and the header
            self.image.value = self._render(set(flagged))
            self.render_seconds += time.perf_counter() - began
            self.header.value = f"<b>{self.title}</b>: {status or self._status(flagged)}"
            self.draws += 1
        return True

    def _status(self, flagged: list[int]) -> str:
        step = self.table.latest_step
        if step is None:
            return "waiting for the first step"
        stragglers = f"; <span style='color:#cc3311'>straggler: rank {', '.join(map(str, flagged))}</span>" if flagged else ""
        return f"step {step + 1}, {self.table.total_throughput():,.0f} samples/s in total{stragglers}"

    def _render(self, flagged: set[int]) -> bytes:
        table = self.table
        # A rank's last WINDOW_STEPS rows reach back at least as far as the axis does.
        rates = {rank: table.throughput(rank, last=WINDOW_STEPS) for rank in self._rate_lines}
        latest = max([steps[-1] for steps, _ in rates.values() if steps] + [0])
        step_span = step_range(latest, self.planned_steps)
        # Only what is visible is drawn (and sets the value ranges): a frame costs the same at any step.
        rates = {rank: _within(step_span, *series) for rank, series in rates.items()}
        loss_steps, losses = _within(step_span, *table.loss())
        shares = table.split()
        traffic = table.bytes_per_rank()
        kinds = table.by_collective()
        for event in table.slow_events():
            if event not in self._marked_events:
                self._mark(event)
                self._background = None
        if tuple(kinds) != self._kinds:
            self._lay_out_collectives(kinds)
        limits = self._wanted_limits(step_span, rates, shares, kinds, losses)
        if self._background is None or limits != self._limits:
            self._apply_limits(limits)
            self.figure.canvas.draw()  # the background: everything not animated
            self._background = self.figure.canvas.copy_from_bbox(self.figure.bbox)
        else:
            self.figure.canvas.restore_region(self._background)
        for rank, line in self._rate_lines.items():
            line.set_data(*rates[rank])
            line.set_linewidth(2.5 if rank in flagged else 1)
            self._throughput.draw_artist(line)
        for rank, compute_bar, waiting_bar, mark in zip(
            self._rate_lines, self._compute_bars, self._waiting_bars, self._straggler_marks
        ):
            compute, waiting = (value * 1000 for value in shares.get(rank, (0.0, 0.0)))
            compute_bar.set_height(compute)
            waiting_bar.set_y(compute)
            waiting_bar.set_height(waiting)
            mark.set_position((rank, compute + waiting))
            mark.set_visible(rank in flagged)
            for artist in (compute_bar, waiting_bar, mark):
                self._split.draw_artist(artist)
        for rank, label in zip(self._rate_lines, self._traffic_labels):
            label.set_text(format_bytes(traffic[rank]) if traffic.get(rank) else "")
            self._split.draw_artist(label)
        for bar, label, (seconds, size) in zip(self._kind_bars, self._kind_labels, kinds.values()):
            bar.set_width(seconds * 1000)
            label.set_position((seconds * 1000, label.get_position()[1]))
            label.set_text(f" {format_bytes(size)}")
            self._collectives.draw_artist(bar)
            self._collectives.draw_artist(label)
        self._loss_line.set_data(loss_steps, losses)
        self._loss.draw_artist(self._loss_line)
        return _encode(self.figure.canvas, "JPEG")

    def _wanted_limits(self, step_span, rates, shares, kinds, losses) -> tuple:
        """Axis ranges, changed in coarse jumps so the background is seldom redrawn."""
        top_rate = max([max(values) for _, values in rates.values() if values] + [1.0])
        top_split = max([sum(pair) * 1000 for pair in shares.values()] + [1.0]) * 1.25  # room for the legend
        top_comm = max([seconds * 1000 for seconds, _ in kinds.values()] + [1.0])
        top_loss = max(losses + [1e-3])
        return (step_span, _grow(top_rate, 1.5), _grow(top_split, 1.5), _grow(top_comm, 1.5), _grow(top_loss, 1.5))

    def _apply_limits(self, limits: tuple) -> None:
        self._limits = limits
        steps, rate, split, comm, loss = limits
        self._throughput.set_xlim(*steps)
        self._throughput.set_ylim(0, rate)
        self._loss.set_xlim(*steps)
        self._loss.set_ylim(0, loss)
        self._split.set_ylim(0, split)
        self._split.set_xlim(-0.6, len(self._rate_lines) - 0.4)
        self._collectives.set_xlim(0, comm)

    def _lay_out_collectives(self, kinds: dict) -> None:
        for artist in [*self._kind_bars, *self._kind_labels]:
            artist.remove()
        self._kinds = tuple(kinds)
        # Numeric positions: categorical ones would remember kinds that have gone.
        self._kind_bars = list(self._collectives.barh(range(len(kinds)), [0] * len(kinds), color="#66ccee",
                                                      animated=True))
        self._kind_labels = [self._collectives.text(0, index, "", va="center", fontsize=8, animated=True)
                             for index in range(len(kinds))]
        self._collectives.set_yticks(range(len(kinds)), list(kinds))
        self._collectives.set_ylim(-0.6, max(len(kinds), 1) - 0.4)
        self._background = None

    def _mark(self, event) -> None:
        rank, step, delay = event
        self._marked_events.add(event)
        text = f"rank {rank} +{delay * 1000:.0f} ms" if delay else f"rank {rank} back to normal"
        # In data coordinates: when the step window moves, the marks move with it
        # (the lines are clipped to the axes once their step has scrolled out).
        for axes in (self._throughput, self._loss):
            axes.axvline(step, color=_colour(rank), linestyle="--", linewidth=1)
        # Clipped explicitly: with mixed coordinates matplotlib would draw the label
        # of a step scrolled out of view beside the axes, over the neighbouring panel.
        self._throughput.annotate(text, (step, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                                  fontsize=7, va="bottom", ha="right", color=_colour(rank), annotation_clip=True)

    def mark_failure(self, ranks, step: int, what: str = "died") -> None:
        """A failure on the step axes: which ranks went, after which step (kept if the run heals)."""
        text = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {what}"
        with self._lock:
            for axes in (self._throughput, self._loss):
                axes.axvline(step, color="#cc3311", linewidth=1.5)
            self._throughput.annotate(text, (step, 0.98), xycoords=("data", "axes fraction"), rotation=90,
                                      fontsize=7, va="top", ha="right", color="#cc3311", annotation_clip=True)
            self.failures.append((tuple(ranks), step, what))
            self._background = None  # the marks are part of the background: draw it again

    def finish(self, status: str) -> None:
        """Last redraw; leave the final picture as a plain image output as well."""
        self.update(force=True, status=status)
        self.stop_button.disabled = True
        self.stop_button.description = "Done"
        if self._final is not None:
            # Same (empty) text as the placeholder: only the picture differs from run to run.
            picture = base64.b64encode(_encode(self.figure.canvas, "PNG")).decode("ascii")
            self._final.update({"image/png": picture, "text/plain": ""}, raw=True)
