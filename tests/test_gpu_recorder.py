"""The GPU step recorder's bookkeeping, run on CPU with stand-in events.

``CudaStepRecorder`` only ever asks an event for ``record``-time order,
``query``, ``synchronize`` and ``elapsed_time``; here each stand-in event is
the CPU clock at the moment it is "recorded", so the recorder's logic (steps
pending until their events are done, collectives, wait regions from
``Work.wait`` and from the end of a real autograd backward) runs for real
without a GPU. The device-side timing itself is checked by bench/gpu.py.
"""

import time

import pytest
import torch

from labkit.rank import gpu_recorder as gpu_instruments
from labkit.rank.gpu_recorder import CudaStepRecorder


class StandInEvent:
    def __init__(self) -> None:
        self.at = time.perf_counter()
        self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, later: "StandInEvent") -> float:
        return (later.at - self.at) * 1000.0  # milliseconds, as CUDA reports


def recording_into(events: list):
    """A stand-in for "record an event now" that also keeps each event made."""
    def record():
        events.append(StandInEvent())
        return events[-1]

    return record


@pytest.fixture
def recorder(monkeypatch):
    events = []
    monkeypatch.setattr(gpu_instruments, "_event", recording_into(events))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute stream")
    made = CudaStepRecorder(rank=3, device=torch.device("cpu"))
    made.events = events
    return made


def test_a_step_row_from_events_adds_up(recorder):
    recorder.begin_step(0)
    token = recorder.issued("cuda")
    assert recorder.issued("cpu") is None  # the lab's own CPU traffic is not the model's
    time.sleep(0.004)
    with recorder.waiting():  # a Work.wait() of the compute stream, for that all-reduce
        time.sleep(0.010)
        recorder.completed("all_reduce", 4096, token)
    model = torch.nn.Linear(4, 1)
    loss = model(torch.ones(8, 4)).pow(2).mean()
    last_bucket = recorder.issued("cuda")
    with recorder.backward_watch(loss):  # the end of backward, where DDP and FSDP wait
        loss.backward()
        time.sleep(0.005)  # stands for a reducer's final wait, inside backward()
        recorder.completed("all_reduce", 4096, last_bucket)
    time.sleep(0.003)
    recorder.end_step(samples=8, tokens=None, loss=loss.detach(), delay=0.0)
    recorder.finish()
    (row,) = recorder.rows
    assert row["rank"] == 3 and row["step"] == 0 and row["loss"] == pytest.approx(float(loss.detach()))
    assert row["compute"] + row["exposed_comm"] == pytest.approx(row["seconds"])
    assert 0.015 <= row["exposed_comm"] < row["seconds"]  # both wait regions, not the rest
    assert row["comm"]["all_reduce"] >= 0.014 and row["bytes"] == {"all_reduce": 8192}
    (entry,) = recorder.timeline
    assert [busy for *_, busy in entry["busy"]].count(0.0) == 2


def test_rows_wait_until_the_device_has_passed_their_events(recorder):
    recorder.begin_step(0)
    recorder.end_step(samples=8, tokens=None, loss=None)
    assert len(recorder.rows) == 1  # all its events were done at once
    recorder.begin_step(1)
    unfinished = recorder.events[-1]
    unfinished.done = False  # the device has not reached the start of step 1 yet
    recorder.end_step(samples=8, tokens=None, loss=None)
    recorder.begin_step(2)
    recorder.end_step(samples=8, tokens=None, loss=None)
    assert [row["step"] for row in recorder.rows] == [0]  # step 2 waits behind step 1, in order
    recorder.finish()  # waits for the device
    assert [row["step"] for row in recorder.rows] == [0, 1, 2]


def test_waits_off_the_compute_stream_and_outside_steps_are_not_exposed(recorder, monkeypatch):
    with recorder.waiting():
        pass  # no step: nothing to note
    recorder.begin_step(0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "all-gather stream")
    with recorder.waiting():  # FSDP waiting on its own stream does not stall compute
        time.sleep(0.005)
    recorder.end_step(samples=8, tokens=None, loss=None)
    recorder.finish()
    assert recorder.rows[0]["exposed_comm"] == 0.0


def test_gpu_step_times_are_periods_read_as_the_device_passes_them(monkeypatch):
    from labkit.rank import step_timer as step_timer

    monkeypatch.setattr(step_timer, "_cuda_event", recording_into([]))
    timer = step_timer.StepTimer(torch.device("cuda"))
    for step in range(50):
        timer.begin()
        time.sleep(0.001)
        timer.end()
        time.sleep(0.001)  # between steps: the next batch is prepared; it counts in the period
    assert len(timer._begins) == 1  # read and let go as the run went, all but the current step
    assert timer.seconds_of(10) >= 0.002 and timer.seconds_of(49) is None  # the last is not closed yet
    seconds = timer.seconds()
    assert len(seconds) == 50 and all(value >= 0.002 for value in seconds[:-1])
    assert 0.001 <= seconds[-1] < seconds[0] + 0.5  # the last runs from its begin to its end
