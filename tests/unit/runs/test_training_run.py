"""A ``TrainingRun`` with a dashboard, driven by a fake session: what its last draw shows. No ranks.

The fake session's ``begin`` returns work whose ``wait`` hands back finished rank
reports at once, as ``RankWork.wait`` would after the ranks answered.
"""

import pytest

from labkit.cluster.control import ControlRequests
from labkit.runs.training_run import TrainingRun
from labkit.spec.train_config import resolve

LOSSES = [[0.9, 0.7, 0.5], [1.1, 0.9, 0.7]]  # the dp mean is 1.0, 0.8, 0.6


def row(rank, step):
    return {"step": step, "rank": rank, "start": 100.0 + step, "seconds": 0.01, "compute": 0.006,
            "exposed_comm": 0.004, "comm": {"all_reduce": 0.003}, "bytes": {"all_reduce": 1000},
            "samples": 4, "tokens": None, "loss": LOSSES[rank][step], "delay": 0.0}


def rank_result(rank):
    return {"rank": rank, "coordinate": {"dp": rank}, "owns_loss": True, "losses": LOSSES[rank],
            "step_seconds": [0.02, 0.01, 0.01], "steps_done": 3,
            "memory": {"params": 100, "grads": 100, "optimizer": 200},
            "rows": [row(rank, step) for step in range(3)], "timeline": [], "device_name": "cpu"}


class FakeWork:
    def __init__(self, reports, failed):
        self.reports, self.failed, self.results = reports, failed, {}

    def wait(self):
        return self.reports


class FakeSession:
    world_size = 2
    generation = 1

    def __init__(self, reports, failed=False):
        self.control = ControlRequests()
        self.reports, self.failed = reports, failed
        self.last_training = None
        self.released = 0

    def begin(self, ranks, function, args, timeout, output, on_tick, on_interrupt):
        self.output = output
        return FakeWork(self.reports, self.failed)

    def release(self, run):
        self.released += 1

    def remember_training(self, config, steps_done):
        self.last_training = (config, steps_done)

    def remember_interrupted(self, interrupted):
        self.interrupted = interrupted

    def failure(self, work, reports, timeout):
        return RuntimeError("rank 1 raised ZeroDivisionError: division by zero")

    def call(self, ranks, function, args, timeout):
        """Where the ranks' training state stands after the failure: rank 1 lost its state."""
        return [{"step": 3, "updating": False, "formation": 1, "current": True}, None]


def finished_run(reports, failed=False):
    config = resolve(2, strategy="ddp", model="mlp", steps=3, global_batch=8)
    run = TrainingRun(FakeSession(reports, failed), config, timeout=30, dashboard=True, background=False)
    return run.start()


def test_a_finished_run_leaves_its_whole_history_in_the_last_picture():
    run = finished_run({rank: {"rank": rank, "ok": True, "value": rank_result(rank)} for rank in range(2)})
    report = run.wait(1)
    assert report.losses == pytest.approx([1.0, 0.8, 0.6])
    assert run.status() == "done: 3 steps, loss 0.6000"
    assert list(run.dashboard.picture.loss_line.get_xdata()) == [0, 1, 2]
    assert list(run.dashboard.picture.loss_line.get_ydata()) == pytest.approx([1.0, 0.8, 0.6])
    assert run.dashboard.stop_button.description == "Done"


def test_the_last_header_says_the_run_is_done():
    run = finished_run({rank: {"rank": rank, "ok": True, "value": rank_result(rank)} for rank in range(2)})
    run.wait(1)
    assert run.dashboard.header.value.endswith(": done: 3 steps, loss 0.6000")


def test_the_last_header_of_a_failed_run_says_it_failed():
    report = {"rank": 1, "ok": False, "error": {"type": "ZeroDivisionError", "message": "division by zero",
                                                "traceback": "", "kind": "raised"}}
    run = finished_run({0: {"rank": 0, "ok": True, "value": rank_result(0)}, 1: report}, failed=True)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run.wait(1)
    assert "failed: rank 1 raised ZeroDivisionError" in run.dashboard.header.value


def test_a_rank_that_died_is_marked_on_the_dashboard_at_its_step():
    from labkit.spec.errors import RankFailure

    died = {"rank": 1, "ok": False, "error": {"type": "ProcessDied", "message": "the rank's process exited",
                                              "traceback": "", "kind": "died"}}
    reports = {0: {"rank": 0, "ok": True, "value": rank_result(0)}, 1: died}
    config = resolve(2, strategy="ddp", model="mlp", steps=3, global_batch=8)
    session = FakeSession(reports, failed=True)
    session.failure = lambda work, got, timeout: RankFailure(got)
    run = TrainingRun(session, config, timeout=30, dashboard=True, background=False)
    for rank in range(2):  # the steps the ranks had published before rank 1 died
        run.table.merge({"rank": rank, "seq": 1, "rows": [row(rank, step) for step in range(2)]})
    run.start()
    with pytest.raises(RankFailure, match="rank 1 died"):
        run.wait(1)
    assert run.dashboard.failures == [((1,), 2, "died")]
    marks = [text.get_text() for text in run.dashboard.picture.throughput.texts]
    assert "rank 1 died" in marks


def test_a_foreground_dashboard_run_keeps_progress_lines_out_of_the_cell():
    run = finished_run({rank: {"rank": rank, "ok": True, "value": rank_result(rank)} for rank in range(2)})
    run.wait(1)
    assert run.session.output.silent, "progress goes to the dashboard's status line, not under it"
    run.session.output.texts.update(0, "step    1/3  loss 1.0000\nstep    3/3  loss 0.6000\n", "")
    run.tick(type("Work", (), {"results": {}, "output": run.session.output})())
    assert "[rank 0] step    3/3  loss 0.6000" in run.dashboard.status_line.value


def test_a_runs_display_in_a_notebook_is_brought_up_to_date_when_it_ends(monkeypatch):
    import IPython.display

    handles = []

    class Handle:
        def __init__(self, bundle):
            self.text = bundle["text/plain"]

        def update(self, bundle, raw=False):
            self.text = bundle["text/plain"]

    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw, display_id: handles.append(Handle(bundle))
                        or handles[-1])
    reports = {rank: {"rank": rank, "ok": True, "value": rank_result(rank)} for rank in range(2)}
    config = resolve(2, strategy="ddp", model="mlp", steps=3, global_batch=8)
    run = TrainingRun(FakeSession(reports), config, timeout=30, dashboard=False, background=False)
    run._ipython_display_()  # what the cell shows before the run ends
    assert handles[0].text.endswith(": starting>")
    run.start()
    assert handles[0].text.endswith(": done: 3 steps, loss 0.6000>")
