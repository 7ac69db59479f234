"""The dashboard from a hand-filled MetricsTable, no processes: its step axis follows the run, its final
picture is legible (size, resolution, fonts, labels, smoothing, marks), and a notebook shows it once."""

import io

import pytest
from matplotlib.text import Text
from PIL import Image

import labkit.views.dashboard as dashboard_module
from labkit.views.dashboard import FIRST_STEPS, WINDOW_STEPS, Dashboard, step_range
from labkit.views.dashboard_figure import (
    DISPLAY_DPI,
    FIGURE_INCHES,
    FINAL_SCALE,
    MIN_FONT_POINTS,
    RANK_COLOURS,
    SLOWDOWN,
    moving_average,
)
from labkit.views.metrics import MetricsTable


def row(rank, step, delay=0.0):
    return {"rank": rank, "step": step, "start": step * 0.03, "seconds": 0.03, "compute": 0.01,
            "exposed_comm": 0.02, "comm": {"all_reduce": 0.02}, "bytes": {"all_reduce": 1000}, "samples": 8,
            "tokens": None, "loss": 1.0 / (step + 1), "delay": delay}


def run_until(dashboard, table, last_step, slow_from=None, first_step=0):
    table.merge_rows([row(rank, step, 0.03 if slow_from is not None and rank == 1 and step >= slow_from else 0.0)
                      for step in range(first_step, last_step + 1) for rank in (0, 1)])
    assert dashboard.update(force=True)


def assert_present_fills_the_axis(dashboard, step):
    picture = dashboard.picture
    first, last = picture.throughput.get_xlim()
    assert first <= step <= last, "the newest step is on the axis"
    assert last - first <= 300, "a few hundred steps at most"
    assert step >= (first + last) / 2, "the newest step is in the right half"
    assert picture.loss.get_xlim() == (first, last)
    for line in [*picture.rate_lines.values(), *picture.raw_lines.values(), picture.loss_line]:
        steps = list(line.get_xdata())
        assert steps and first <= steps[0] and steps[-1] == step, "only the visible steps are drawn"


def test_a_long_run_shows_its_recent_steps():
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=3000)
    run_until(dashboard, table, 100)
    assert_present_fills_the_axis(dashboard, 100)
    run_until(dashboard, table, 2500, slow_from=2450, first_step=101)
    assert_present_fills_the_axis(dashboard, 2500)
    # The slowdown is marked at its step, which is on the axis now.
    picture = dashboard.picture
    data_lines = {*picture.rate_lines.values(), *picture.raw_lines.values()}
    slowdown_lines = [line for line in picture.throughput.lines if line not in data_lines]
    assert [list(line.get_xdata()) for line in slowdown_lines] == [[2450, 2450]]
    first, last = picture.throughput.get_xlim()
    assert first < 2450 < last


def test_the_axis_moves_in_jumps_not_every_step():
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=3000)
    run_until(dashboard, table, 1000)
    before = dashboard.picture.throughput.get_xlim()
    run_until(dashboard, table, 1010, first_step=1001)
    assert dashboard.picture.throughput.get_xlim() == before  # the background stays as it was
    spans = {step_range(step, 3000) for step in range(1000, 1500)}
    assert len(spans) <= 500 // (WINDOW_STEPS // 2) + 2  # one per half window, plus the partial ends


def test_a_short_run_is_shown_whole():
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=20)
    run_until(dashboard, table, 19)
    assert dashboard.picture.throughput.get_xlim() == (0, 20)
    assert list(dashboard.picture.rate_lines[0].get_xdata()) == list(range(20))


def test_step_range_without_a_plan():
    assert step_range(0) == (0, 16)
    assert step_range(100) == (0, 128)
    for latest in range(0, 5000, 7):
        first, last = step_range(latest)
        assert first <= latest <= last and last - first <= WINDOW_STEPS
        if latest >= FIRST_STEPS // 2:  # a young run's axis starts FIRST_STEPS wide
            assert latest + 1 >= (first + last) / 2


# -- the final picture: legible as a figure in a paper ----------------------------------


def finished_run(steps=120, slow=range(30, 60), ranks=4):
    """A run in which rank 1 computes 30 ms longer over ``slow`` steps, then recovers; drawn every step."""
    table = MetricsTable(ranks, global_batch=8 * ranks)
    dashboard = Dashboard(table, "mlp under ddp", planned_steps=steps)
    for step in range(steps):
        slowed = step in slow
        table.merge_rows([{**row(rank, step, 0.03 if slowed and rank == 1 else 0.0),
                           "compute": 0.04 if slowed and rank == 1 else 0.01,
                           "seconds": 0.06 if slowed else 0.03 + 0.002 * (step % 3)}
                          for rank in range(ranks)])
        dashboard.update(force=True)
    dashboard.finish("done: 120 steps, loss 0.0083")
    return table, dashboard


@pytest.fixture(scope="module")
def finished():
    """One finished run (drawn 120 times, a few seconds) that the picture's tests only read."""
    return finished_run()


def test_the_final_picture_is_a_sharp_png_at_twice_the_display_size(finished):
    _, dashboard = finished
    picture = Image.open(io.BytesIO(dashboard.final_picture))
    assert picture.format == "PNG"
    shown = dashboard.picture.display_size
    assert shown == (round(FIGURE_INCHES[0] * DISPLAY_DPI), round(FIGURE_INCHES[1] * DISPLAY_DPI))
    assert shown[0] >= 900, "wide enough to read four panels"
    assert picture.size == (shown[0] * FINAL_SCALE, shown[1] * FINAL_SCALE), "2 dots per displayed pixel"


def test_every_text_is_at_least_ten_points_and_axes_name_their_units(finished):
    _, dashboard = finished
    texts = [text for text in dashboard.figure.findobj(Text) if text.get_visible() and text.get_text().strip()]
    small = {text.get_text(): text.get_fontsize() for text in texts if text.get_fontsize() < MIN_FONT_POINTS}
    assert MIN_FONT_POINTS >= 10 and not small, f"text under {MIN_FONT_POINTS} pt: {small}"
    picture = dashboard.picture
    assert picture.throughput.get_ylabel() == "samples/s" and picture.throughput.get_xlabel() == "step"
    assert picture.split.get_xlabel().startswith("rank") and "bytes" in picture.split.get_xlabel()
    assert picture.split.get_ylabel() == "ms per step"
    assert picture.collectives.get_xlabel().startswith("ms per step") and "bytes" in picture.collectives.get_xlabel()
    assert "loss" in picture.loss.get_ylabel()
    # The bytes each rank moved are named under its rank, not unexplained labels on the bars.
    assert [label.get_text() for label in picture.split.get_xticklabels()][1] == "1\n1.0 kB"
    assert "done: 120 steps" in picture.status.get_text()


def test_throughput_is_a_moving_average_over_the_faint_steps_and_the_window_can_change(finished):
    table, dashboard = finished
    picture = dashboard.picture
    steps, rates = table.throughput(0, last=None)
    assert list(picture.raw_lines[0].get_ydata()) == pytest.approx(rates)
    assert list(picture.rate_lines[0].get_ydata()) == pytest.approx(moving_average(rates, 10))
    assert picture.raw_lines[0].get_alpha() <= 0.4 < picture.rate_lines[0].get_linewidth()
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]

    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=50)
    run_until(dashboard, table, 40)
    dashboard.set_smoothing(25)
    assert dashboard.smoothing == dashboard.smoothing_box.value == 25
    _, rates = table.throughput(0, last=None)
    assert list(dashboard.picture.rate_lines[0].get_ydata()) == pytest.approx(moving_average(rates, 25))
    assert any("mean of last 25 steps" in text.get_text() for text in dashboard.figure.legends[0].get_texts())


def test_the_legend_is_outside_the_panels(finished):
    _, dashboard = finished
    picture = dashboard.picture
    assert picture.throughput.get_legend() is None and picture.loss.get_legend() is None
    renderer = dashboard.figure.canvas.get_renderer()
    legend = dashboard.figure.legends[0].get_window_extent(renderer)
    for axes in (picture.throughput, picture.split):
        assert legend.y0 >= axes.get_window_extent(renderer).y1, "above the top panels"


def test_slowdown_marks_use_no_rank_colour_and_their_labels_stand_out(finished):
    _, dashboard = finished
    picture = dashboard.picture
    data_lines = {*picture.rate_lines.values(), *picture.raw_lines.values()}
    marks = [line for line in picture.throughput.lines if line not in data_lines]
    assert len(marks) == 2  # slowed at step 30, back to normal at step 60
    assert {line.get_color() for line in marks} == {SLOWDOWN} and SLOWDOWN not in RANK_COLOURS
    labels = [text for text in picture.throughput.texts if "rank 1 +30 ms" in text.get_text()
              or "back to normal" in text.get_text()]
    assert len(labels) == 2
    for label in labels:
        assert label.get_bbox_patch() is not None, "a white box keeps the label readable over the lines"
        assert label.get_zorder() > max(line.get_zorder() for line in data_lines)


def test_a_straggler_stays_marked_after_its_flag_clears(finished):
    table, dashboard = finished
    assert table.flagged() == [], "recovered by the end"
    [(rank, first, last)] = dashboard.flags.as_tuples()
    assert rank == 1 and 30 <= first < 45 and 55 <= last < 70
    rectangle, label = dashboard.picture.straggler_spans[0]
    assert rectangle.get_x() == first and rectangle.get_width() == last + 1 - first
    assert label.get_text() == "rank 1 straggler"


# -- shown once ------------------------------------------------------------------------------


class Handle:
    def __init__(self, bundle):
        self.shown, self.updates = bundle, []

    def update(self, bundle, metadata=None, raw=False):
        self.updates.append((bundle, metadata))


def test_a_notebook_shows_the_dashboard_once_and_the_final_picture_takes_its_place(monkeypatch):
    displays = []

    def display(bundle, raw=False, display_id=False):
        displays.append(Handle(bundle))
        return displays[-1]

    monkeypatch.setattr(dashboard_module, "in_kernel", lambda: True)
    monkeypatch.setattr(dashboard_module, "display", display)
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "mlp under ddp", planned_steps=20)
    dashboard.show()
    run_until(dashboard, table, 19)
    dashboard.finish("done: 20 steps, loss 0.0500")
    [handle] = displays
    assert "application/vnd.jupyter.widget-view+json" in handle.shown
    [(final, metadata)] = handle.updates
    assert set(final) == {"image/png", "text/plain"}, "the widget is replaced, not followed by a copy"
    assert final["text/plain"] == handle.shown["text/plain"] == "training dashboard: mlp under ddp"
    assert metadata["image/png"]["width"] == dashboard.picture.display_size[0]
    assert list(dashboard.picture.loss_line.get_xdata()) == list(range(20)), "the last frame has every step"


def test_progress_goes_to_the_status_line():
    dashboard = Dashboard(MetricsTable(2, global_batch=16), "ddp")
    dashboard.set_progress("[rank 0] step   10/200  loss 1.2345")
    assert "step   10/200" in dashboard.status_line.value


def test_a_watched_loop_shows_the_most_a_rank_holds():
    table = MetricsTable(2, None)
    dashboard = Dashboard(table, "train.py")
    table.merge({"rank": 0, "seq": 1, "rows": [row(0, step) for step in range(3)],
                 "memory": {"params": 2_000_000, "grads": 2_000_000, "optimizer": 4_000_000}})
    table.merge({"rank": 1, "seq": 1, "rows": [row(1, step) for step in range(3)]})
    assert dashboard.update(force=True)
    assert "at most 8.0 MB per rank" in dashboard.header.value and "samples/s" in dashboard.header.value
