"""The dashboard's picture: a matplotlib figure made once, then fed new data each frame.

Four panels: throughput per rank (each step faint, a moving average over
``smoothing`` steps bold); each rank's step split into compute and exposed
communication, with the bytes it moved per step under its number; communication
time and bytes by collective; the loss. Injected slowdowns are marked on the
step axes in a colour no rank uses; a rank flagged as a straggler gets a shaded
span over the steps it was flagged, which stays after the flag clears.

Sizes are chosen for the page, not the screen: the figure is ``FIGURE_INCHES``
at ``DISPLAY_DPI`` (96, a CSS pixel per dot), so a point on the picture is a
point in the notebook and no text is under ``MIN_FONT_POINTS``. Live frames are
drawn at that size; the final picture is drawn again at twice the resolution
and shown at the same size, so its text stays sharp on high-density displays.

Axes, ticks and labels are drawn only when a range changes; each frame
restores that background and draws just the data ("blitting"): text is most
of what matplotlib spends on a frame. No pyplot, so any thread may draw.
"""

from __future__ import annotations

import bisect
import io

from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Annotation, Text
from matplotlib.ticker import MaxNLocator

from labkit.units import format_bytes
from labkit.views.metrics import MetricsTable

# The step axis never spans more than this many steps; it moves half of it at a time.
WINDOW_STEPS = 256
# A young run's axis starts this wide, so its first frames do not redraw the background each step.
FIRST_STEPS = 16
DEFAULT_SMOOTHING = 10  # steps in the throughput's moving average

DISPLAY_DPI = 96  # a CSS pixel per dot: the picture's points are the page's points
FIGURE_INCHES = (10.0, 7.2)
FINAL_SCALE = 2  # the final picture's dots per displayed pixel (high-density displays)
MIN_FONT_POINTS = 10
TICK_POINTS, LABEL_POINTS, TITLE_POINTS = 10, 11, 12

RANK_COLOURS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000")
COMPUTE, WAITING = "#4477aa", "#ee9944"
# Marks must not read as a rank's line: colours outside RANK_COLOURS.
SLOWDOWN = "#8c510a"  # injected slowdowns (dark brown)
FAILURE = "#cc3311"  # ranks that died
STRAGGLER = "#cc3311"  # flagged stragglers' spans (shaded, so never mistaken for a line)
LABEL_BOX = dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.85)


def rank_colour(rank: int) -> str:
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


def within(step_span: tuple[int, int], steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """The part of a step series (steps ascending) that falls on the visible axis."""
    start = bisect.bisect_left(steps, step_span[0])
    stop = bisect.bisect_right(steps, step_span[1])
    return steps[start:stop], values[start:stop]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start): one number per value."""
    window = max(1, int(window))
    result, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        result.append(total / min(index + 1, window))
    return result


def encode(canvas, image_format: str) -> bytes:
    """The drawn canvas as JPEG (live frames: a third of PNG's encoding time) or PNG."""
    from PIL import Image as PILImage

    width, height = canvas.get_width_height()
    picture = PILImage.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buffer = io.BytesIO()
    if image_format == "JPEG":
        # 4:4:4 keeps the colour edges of thin text and lines; quality 90 leaves no visible ringing.
        picture.convert("RGB").save(buffer, format="JPEG", quality=90, subsampling=0)
    else:
        picture.convert("RGB").save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


class DashboardFigure:
    """The four panels for ``ranks``; ``render`` draws one frame of a ``MetricsTable``."""

    def __init__(self, ranks: list[int], title: str, planned_steps: int | None = None,
                 smoothing: int = DEFAULT_SMOOTHING) -> None:
        self.ranks = list(ranks)
        self.title = title
        self.planned_steps = planned_steps
        self.smoothing = smoothing
        self.figure = Figure(figsize=FIGURE_INCHES, dpi=DISPLAY_DPI)
        self.canvas = FigureCanvasAgg(self.figure)  # Agg's: the frames are blitted (copy and restore a region)
        self.figure.subplots_adjust(left=0.11, right=0.98, top=0.80, bottom=0.09, hspace=0.55, wspace=0.25)
        axes = self.figure.subplots(2, 2)
        self.throughput, self.split, self.collectives, self.loss = axes.flat
        for ax in axes.flat:
            ax.tick_params(labelsize=TICK_POINTS)
            ax.yaxis.set_major_locator(MaxNLocator(5))
        for ax in (self.throughput, self.loss):
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
        self.figure.text(0.01, 0.985, title, fontsize=TITLE_POINTS + 1, weight="bold", va="top")
        # The run's state, written into the final picture only (live, the widget's header says it).
        self.status = self.figure.text(0.01, 0.945, "", fontsize=LABEL_POINTS, va="top")
        self._build_throughput()
        self._build_split()
        self._build_collectives()
        self._build_loss()
        self._legend: Legend | None = None
        self._build_legend()
        self._marked_events: set = set()
        self._spans: list[tuple[Rectangle, Annotation]] = []  # per straggler span, in FlagHistory's order
        self._limits: tuple | None = None
        self._background: object | None = None  # the axes drawn without the data (an Agg region), restored each frame

    # -- building -------------------------------------------------------------

    def _build_throughput(self) -> None:
        ax = self.throughput
        self.raw_lines = {rank: ax.plot([], [], color=rank_colour(rank), linewidth=0.8, alpha=0.3, animated=True)[0]
                          for rank in self.ranks}
        self.rate_lines = {rank: ax.plot([], [], color=rank_colour(rank), linewidth=2, animated=True)[0]
                           for rank in self.ranks}
        ax.set_title("throughput per rank", fontsize=TITLE_POINTS)
        ax.set_xlabel("step", fontsize=LABEL_POINTS)
        ax.set_ylabel("samples/s", fontsize=LABEL_POINTS)

    def _build_split(self) -> None:
        ax = self.split
        self.compute_bars = ax.bar(self.ranks, [0] * len(self.ranks), color=COMPUTE, animated=True)
        self.waiting_bars = ax.bar(self.ranks, [0] * len(self.ranks), color=WAITING, animated=True)
        ax.set_title("step time per rank (mean of recent steps)", fontsize=TITLE_POINTS)
        ax.set_ylabel("ms per step", fontsize=LABEL_POINTS)
        ax.set_xlabel("rank  (under it: bytes it moved per step)", fontsize=LABEL_POINTS)
        ax.set_xticks(self.ranks)
        # Above the bars, in headroom the y range keeps for it: never over the data.
        ax.legend(handles=[Patch(color=COMPUTE, label="compute"), Patch(color=WAITING, label="exposed communication")],
                  fontsize=TICK_POINTS, loc="upper center", ncol=2, frameon=False)
        self.straggler_marks = [
            ax.text(rank, 0, "straggler", ha="center", va="bottom", fontsize=TICK_POINTS, color=STRAGGLER,
                    weight="bold", animated=True, visible=False)
            for rank in self.ranks
        ]

    def _build_collectives(self) -> None:
        ax = self.collectives
        ax.set_title("communication per step, all ranks", fontsize=TITLE_POINTS)
        ax.set_xlabel("ms per step  (beside each bar: bytes per step)", fontsize=LABEL_POINTS)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        self._kinds: tuple = ()
        self.kind_bars: list[Rectangle] = []
        self.kind_labels: list[Text] = []

    def _build_loss(self) -> None:
        ax = self.loss
        self.loss_line = ax.plot([], [], color="#222222", linewidth=1.5, animated=True)[0]
        ax.set_title("loss", fontsize=TITLE_POINTS)
        ax.set_xlabel("step", fontsize=LABEL_POINTS)
        ax.set_ylabel("loss (mean over ranks)", fontsize=LABEL_POINTS)

    def _build_legend(self) -> None:
        """One legend for the step panels, above them (outside every panel's data)."""
        if self._legend is not None:
            self._legend.remove()
        handles: list[Artist] = [Line2D([], [], color=rank_colour(rank), linewidth=2, label=f"rank {rank}")
                                 for rank in self.ranks]
        handles += [
            Line2D([], [], color="#777777", linewidth=0.8, alpha=0.5, label="each step"),
            Line2D([], [], color="#777777", linewidth=2, label=f"mean of last {self.smoothing} steps"),
            Line2D([], [], color=SLOWDOWN, linewidth=1.5, label="injected slowdown"),
            Patch(color=STRAGGLER, alpha=0.18, label="flagged straggler"),
        ]
        self._legend = self.figure.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.915),
                                          ncol=min(len(handles), 6), fontsize=TICK_POINTS, frameon=False,
                                          handlelength=1.6, columnspacing=1.2)

    def set_smoothing(self, steps: int) -> None:
        self.smoothing = max(1, int(steps))
        self._build_legend()
        self._background = None

    # -- marks ------------------------------------------------------------------

    def mark_slowdown(self, event) -> None:
        rank, step, delay = event
        self._marked_events.add(event)
        text = f"rank {rank} +{delay * 1000:.0f} ms" if delay else f"rank {rank} back to normal"
        self._mark_step(step, text, SLOWDOWN, 1.5)

    def mark_failure(self, ranks, step: int, what: str) -> None:
        self._mark_step(step, f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {what}", FAILURE, 2)

    def _mark_step(self, step: int, text: str, color: str, width: float) -> None:
        """A vertical line at ``step`` on the step panels, labelled along it in a box above the data."""
        # In data coordinates: when the step window moves, the marks move with it.
        for ax in (self.throughput, self.loss):
            ax.axvline(step, color=color, linewidth=width, zorder=3)
        # Clipped explicitly: with mixed coordinates matplotlib would draw the label
        # of a step scrolled out of view beside the axes, over the neighbouring panel.
        self.throughput.annotate(text, (step, 0.97), xycoords=("data", "axes fraction"), rotation=90,
                                 fontsize=TICK_POINTS, va="top", ha="right", color=color, bbox=LABEL_BOX,
                                 annotation_clip=True, zorder=4)
        self._background = None

    @property
    def straggler_spans(self) -> list[tuple[Rectangle, Annotation]]:
        """(shaded rectangle, label) of each straggler span drawn, in ``FlagHistory``'s order."""
        return list(self._spans)

    def _straggler_span(self, index: int, rank: int) -> tuple[Rectangle, Annotation]:
        while len(self._spans) <= index:
            rectangle = self.throughput.axvspan(0, 1, color=STRAGGLER, alpha=0.18, linewidth=0, animated=True)
            label = self.throughput.annotate("", (0, 0.03), xycoords=("data", "axes fraction"), fontsize=TICK_POINTS,
                                             color=STRAGGLER, va="bottom", ha="left", bbox=LABEL_BOX,
                                             annotation_clip=True, animated=True)
            self._spans.append((rectangle, label))
        rectangle, label = self._spans[index]
        label.set_text(f"rank {rank} straggler")
        return rectangle, label

    # -- a frame ------------------------------------------------------------------

    def render(self, table: MetricsTable, flagged: set[int], spans: list[tuple[int, int, int]],
               image_format: str = "JPEG") -> bytes:
        """Draw ``table`` (``spans``: (rank, first, last step) each rank was flagged); return the frame."""
        reach = WINDOW_STEPS + self.smoothing  # the window, and the steps its first averages need
        rates = {rank: table.throughput(rank, last=reach) for rank in self.ranks}
        latest = max([steps[-1] for steps, _ in rates.values() if steps] + [0])
        step_span = step_range(latest, self.planned_steps)
        smooth = {rank: within(step_span, steps, moving_average(values, self.smoothing))
                  for rank, (steps, values) in rates.items()}
        # Only what is visible is drawn (and sets the value ranges): a frame costs the same at any step.
        rates = {rank: within(step_span, *series) for rank, series in rates.items()}
        loss_steps, losses = within(step_span, *table.loss())
        shares = table.split()
        traffic = table.bytes_per_rank()
        kinds = table.by_collective()
        for event in table.slow_events():
            if event not in self._marked_events:
                self.mark_slowdown(event)
        if tuple(kinds) != self._kinds:
            self._lay_out_collectives(kinds)
        limits = self._wanted_limits(step_span, rates, shares, kinds, losses, traffic)
        if self._background is None or limits != self._limits:
            self._apply_limits(limits)
            self.canvas.draw()  # the background: everything not animated
            self._background = self.canvas.copy_from_bbox(self.figure.bbox)
        else:
            self.canvas.restore_region(self._background)
        self._draw_spans(spans, latest)
        for rank in self.ranks:
            self.raw_lines[rank].set_data(*rates[rank])
            self.throughput.draw_artist(self.raw_lines[rank])
        for rank in self.ranks:
            line = self.rate_lines[rank]
            line.set_data(*smooth[rank])
            line.set_linewidth(3.5 if rank in flagged else 2)
            self.throughput.draw_artist(line)
        for rank, compute_bar, waiting_bar, mark in zip(self.ranks, self.compute_bars, self.waiting_bars,
                                                        self.straggler_marks):
            compute, waiting = (value * 1000 for value in shares.get(rank, (0.0, 0.0)))
            compute_bar.set_height(compute)
            waiting_bar.set_y(compute)
            waiting_bar.set_height(waiting)
            mark.set_position((rank, compute + waiting))
            mark.set_visible(rank in flagged)
            for artist in (compute_bar, waiting_bar, mark):
                self.split.draw_artist(artist)
        for bar, label, (seconds, size) in zip(self.kind_bars, self.kind_labels, kinds.values()):
            bar.set_width(seconds * 1000)
            label.set_position((seconds * 1000, label.get_position()[1]))
            label.set_text(f" {format_bytes(size)}")
            self.collectives.draw_artist(bar)
            self.collectives.draw_artist(label)
        self.loss_line.set_data(loss_steps, losses)
        self.loss.draw_artist(self.loss_line)
        return encode(self.canvas, image_format)

    def _draw_spans(self, spans, latest: int) -> None:
        for index, (rank, first, last) in enumerate(spans):
            rectangle, label = self._straggler_span(index, rank)
            # A span covers its steps whole: from its first step to the end of its last.
            rectangle.set_x(first)
            rectangle.set_width(max(last, first) + 1 - first)
            label.xy = label.xyann = (first, 0.03)  # the point and the text, which sits on it
            self.throughput.draw_artist(rectangle)
            self.throughput.draw_artist(label)

    def _wanted_limits(self, step_span, rates, shares, kinds, losses, traffic) -> tuple:
        """Axis ranges and tick texts, changed in coarse jumps so the background is seldom redrawn."""
        top_rate = max([max(values) for _, values in rates.values() if values] + [1.0])
        top_split = max([sum(pair) * 1000 for pair in shares.values()] + [1.0]) * 1.35  # room for the legend
        top_comm = max([seconds * 1000 for seconds, _ in kinds.values()] + [1.0])
        top_loss = max(losses + [1e-3])
        rank_ticks = tuple(f"{rank}\n{format_bytes(traffic[rank])}" if traffic.get(rank) else f"{rank}"
                           for rank in self.ranks)
        return (step_span, _grow(top_rate, 1.5), _grow(top_split, 1.5), _grow(top_comm, 1.5), _grow(top_loss, 1.5),
                rank_ticks)

    def _apply_limits(self, limits: tuple) -> None:
        self._limits = limits
        steps, rate, split, comm, loss, rank_ticks = limits
        self.throughput.set_xlim(*steps)
        self.throughput.set_ylim(0, rate)
        self.loss.set_xlim(*steps)
        self.loss.set_ylim(0, loss)
        self.split.set_ylim(0, split)
        self.split.set_xlim(-0.6, len(self.ranks) - 0.4)
        self.split.set_xticks(self.ranks, rank_ticks)
        # Room for the byte labels beside the longest bar.
        self.collectives.set_xlim(0, comm * 1.25)

    def _lay_out_collectives(self, kinds: dict) -> None:
        for artist in [*self.kind_bars, *self.kind_labels]:
            artist.remove()
        self._kinds = tuple(kinds)
        # Numeric positions: categorical ones would remember kinds that have gone.
        self.kind_bars = list(self.collectives.barh(range(len(kinds)), [0] * len(kinds), color="#66ccee",
                                                    animated=True))
        self.kind_labels = [self.collectives.text(0, index, "", va="center", fontsize=TICK_POINTS, animated=True)
                            for index in range(len(kinds))]
        self.collectives.set_yticks(range(len(kinds)), list(kinds))
        self.collectives.set_ylim(-0.6, max(len(kinds), 1) - 0.4)
        self._background = None

    # -- the final picture ------------------------------------------------------------

    def final_png(self, status: str) -> bytes:
        """The last frame drawn whole at ``FINAL_SCALE`` times the resolution, with the run's ``status``.

        Animated artists are left out of a full draw, so they join the figure
        for good first (the run is over: no more frames)."""
        self.status.set_text(status)
        for artist in self.figure.findobj(lambda artist: artist.get_animated()):
            artist.set_animated(False)
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=DISPLAY_DPI * FINAL_SCALE)
        self._background = None
        return buffer.getvalue()

    @property
    def display_size(self) -> tuple[int, int]:
        """(width, height) in CSS pixels the pictures are shown at."""
        return round(FIGURE_INCHES[0] * DISPLAY_DPI), round(FIGURE_INCHES[1] * DISPLAY_DPI)
