"""A foreground dashboard run's Stop button, without ranks or a browser.

Where the blocked cell can handle widget messages (jupyter-ui-poll in an
ipykernel it can poll), the wait hands them over between two looks at the ranks
and a click stops the run; elsewhere the run waits as before, without a button,
and the status line says how to stop it. ``tests/lab/test_browser.py`` clicks the
real button in JupyterLab.
"""

import sys
import types

import pytest

import labkit.runs.training_run as training_run
from labkit.runs.training_run import STOP_HINT, TrainingRun, notebook_ui_events
from labkit.spec.train_config import resolve
from tests.unit.runs.test_training_run import FakeSession, rank_result


def stopped_result(rank, steps):
    result = rank_result(rank)
    return {**result, "steps_done": steps, "losses": result["losses"][:steps],
            "step_seconds": result["step_seconds"][:steps], "rows": result["rows"][:steps]}


class TickingWork:
    """Ticks twice, as ``RankWork.wait`` does while ranks train; the ranks stop after step 1 if asked to."""

    def __init__(self, session, on_tick):
        self.session, self.on_tick, self.failed, self.results = session, on_tick, False, {}

    def wait(self):
        for _ in range(2):
            self.on_tick(self)
        steps = 1 if self.session.control.stop else 3
        return {rank: {"rank": rank, "ok": True, "value": stopped_result(rank, steps)} for rank in range(2)}


class TickingSession(FakeSession):
    def __init__(self):
        super().__init__(reports=None)

    def begin(self, ranks, function, args, timeout, output, on_tick, on_interrupt):
        self.output = output
        return TickingWork(self, on_tick)


class FakePoller:
    """Stands for ``jupyter_ui_poll.ui_events``: its first poll delivers a click on the Stop button."""

    def __init__(self):
        self.entered = self.exited = 0
        self.polls = []
        self.run = None

    def __call__(self):
        return self

    def __enter__(self):
        self.entered += 1
        return self.poll

    def __exit__(self, *exc):
        self.exited += 1

    def poll(self, n):
        self.polls.append(n)
        if len(self.polls) == 1:
            self.run.dashboard.stop_button.click()


def foreground_run(session, dashboard=True):
    config = resolve(2, strategy="ddp", model="mlp", steps=3, global_batch=8)
    return TrainingRun(session, config, timeout=30, dashboard=dashboard, background=False)


def test_outside_a_kernel_a_foreground_run_waits_as_before_and_says_how_to_stop_it():
    assert notebook_ui_events() is None, "a test process is not a Jupyter kernel"
    run = foreground_run(TickingSession()).start()
    assert run.wait(1).steps_done == 3
    assert run.dashboard.stop_button.layout.display == "none", "a button nobody can click is not shown"
    assert STOP_HINT in run.dashboard.status_line.value


def test_without_jupyter_ui_poll_a_kernel_waits_as_before(monkeypatch):
    monkeypatch.setattr(training_run, "in_kernel", lambda: True)
    monkeypatch.setitem(sys.modules, "jupyter_ui_poll", None)  # import fails
    assert notebook_ui_events() is None


@pytest.mark.parametrize("version, pollable", [((6, 31, 0), True), ((7, 4, 0), False)])
def test_the_poller_is_used_only_on_a_kernel_it_can_poll(monkeypatch, version, pollable):
    def ui_events():
        raise AssertionError("only handed over, not called here")

    monkeypatch.setattr(training_run, "in_kernel", lambda: True)
    monkeypatch.setitem(sys.modules, "jupyter_ui_poll", types.SimpleNamespace(ui_events=ui_events))
    monkeypatch.setitem(sys.modules, "ipykernel", types.SimpleNamespace(version_info=version))
    assert (notebook_ui_events() is ui_events) is pollable


def test_a_click_handled_while_the_cell_waits_stops_the_run_at_a_step_boundary(monkeypatch):
    poller = FakePoller()
    monkeypatch.setattr(training_run, "notebook_ui_events", lambda: poller)
    session = TickingSession()
    run = foreground_run(session)
    poller.run = run
    assert run.dashboard.stop_button.layout.display != "none"
    assert STOP_HINT not in run.dashboard.status_line.value
    report = run.start().wait(1)
    assert report.stopped_early and report.steps_done == 1
    assert run.status() == "stopped after step 1 of 3"
    assert poller.polls == [training_run.UI_EVENTS_PER_TICK] * 2, "one poll per tick, after its redraw"
    assert (poller.entered, poller.exited) == (1, 1), "one poller for the whole wait, closed when it ends"
    assert not run.polling, "the poller is let go when the wait ends"
    assert not session.control.stop, "the stop request is cleared for the next run"


def test_a_foreground_run_without_a_dashboard_never_polls(monkeypatch):
    monkeypatch.setattr(training_run, "notebook_ui_events", lambda: pytest.fail("nothing to poll for"))
    run = foreground_run(TickingSession(), dashboard=False).start()
    assert run.wait(1).steps_done == 3
