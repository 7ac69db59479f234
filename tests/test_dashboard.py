"""The dashboard's step axis follows the run: drawn from a hand-filled MetricsTable, no processes."""

from labkit.views.dashboard import FIRST_STEPS, WINDOW_STEPS, Dashboard, step_range
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
    first, last = dashboard._throughput.get_xlim()
    assert first <= step <= last, "the newest step is on the axis"
    assert last - first <= 300, "a few hundred steps at most"
    assert step >= (first + last) / 2, "the newest step is in the right half"
    assert dashboard._loss.get_xlim() == (first, last)
    for line in [*dashboard._rate_lines.values(), dashboard._loss_line]:
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
    slowdown_lines = [line for line in dashboard._throughput.lines if line not in dashboard._rate_lines.values()]
    assert [list(line.get_xdata()) for line in slowdown_lines] == [[2450, 2450]]
    first, last = dashboard._throughput.get_xlim()
    assert first < 2450 < last


def test_the_axis_moves_in_jumps_not_every_step():
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=3000)
    run_until(dashboard, table, 1000)
    before = dashboard._throughput.get_xlim()
    run_until(dashboard, table, 1010, first_step=1001)
    assert dashboard._throughput.get_xlim() == before  # the background stays as it was
    spans = {step_range(step, 3000) for step in range(1000, 1500)}
    assert len(spans) <= 500 // (WINDOW_STEPS // 2) + 2  # one per half window, plus the partial ends


def test_a_short_run_is_shown_whole():
    table = MetricsTable(2, global_batch=16)
    dashboard = Dashboard(table, "ddp", planned_steps=20)
    run_until(dashboard, table, 19)
    assert dashboard._throughput.get_xlim() == (0, 20)
    assert list(dashboard._rate_lines[0].get_xdata()) == list(range(20))


def test_step_range_without_a_plan():
    assert step_range(0) == (0, 16)
    assert step_range(100) == (0, 128)
    for latest in range(0, 5000, 7):
        first, last = step_range(latest)
        assert first <= latest <= last and last - first <= WINDOW_STEPS
        if latest >= FIRST_STEPS // 2:  # a young run's axis starts FIRST_STEPS wide
            assert latest + 1 >= (first + last) / 2
