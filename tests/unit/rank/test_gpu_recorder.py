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

from labkit.rank.instruments import gpu_recorder as gpu_instruments
from labkit.rank.instruments.gpu_recorder import CudaStepRecorder


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
    from labkit.rank.instruments import step_timer as step_timer

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


def test_a_collective_that_ran_in_the_compute_stream_is_all_exposed(recorder, monkeypatch):
    recorder.begin_step(0)
    token = recorder.issued("cuda")
    time.sleep(0.006)  # nccl's synchronous all-reduce, run on the compute stream
    recorder.ran_in_stream("all_reduce", 1024, token)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "all-gather stream")
    other = recorder.issued("cuda")
    time.sleep(0.004)  # FSDP's all-gather on its own stream: overlapped, not exposed
    recorder.ran_in_stream("all_gather", 4096, other)
    recorder.end_step(samples=8, tokens=None, loss=None)
    recorder.finish()
    (row,) = recorder.rows
    assert row["bytes"] == {"all_reduce": 1024, "all_gather": 4096}
    assert 0.006 <= row["exposed_comm"] < 0.0095
    assert row["comm"]["all_gather"] >= 0.004


def test_losses_go_through_reused_host_slots_read_once_their_step_has_passed():
    made = []

    def allocate():
        made.append(torch.empty(()))
        return made[-1]

    slots = gpu_instruments.LossSlots(allocate, device_type="cpu")  # CPU tensors stand in for GPU ones
    first = slots.copy(torch.tensor(2.5))
    second = slots.copy(torch.tensor(1.5, dtype=torch.float64))
    assert len(made) == 2 and slots.read(first) == 2.5 and slots.read(second) == 1.5
    third = slots.copy(torch.tensor(0.5))
    assert len(made) == 2 and third.tensor is made[1]  # a read slot is used again
    assert slots.read(third) == 0.5
    assert slots.copy(None) is None and slots.read(None) is None
    assert slots.read(slots.copy(0.25)) == 0.25 and len(made) == 2  # a number is no device tensor
