"""StepRecorder's rows from made-up collectives (no process group): bytes belong to the step that issued them."""

from labkit.rank.instruments.recorder import StepRecorder


def test_bytes_count_in_the_step_that_issued_them_even_when_completion_lands_late():
    recorder = StepRecorder(rank=0)
    recorder.begin_step(0)
    early = recorder.issued("cpu", "all_reduce", 1000)
    recorder.completed("all_reduce", 1000, early)
    late = recorder.issued("cpu", "all_reduce", 4000)  # its callback lands after the step ended
    first = recorder.end_step(samples=8, tokens=None, loss=None)
    recorder.begin_step(1)
    recorder.completed("all_reduce", 4000, late)
    recorder.issued("cpu", "all_gather", 500)
    with recorder.lab_traffic():  # the lab's own agreement: no bytes of the loop's
        recorder.issued("cpu", "all_reduce", 4)
    second = recorder.end_step(samples=8, tokens=None, loss=None)
    assert first["bytes"] == {"all_reduce": 5000}
    assert second["bytes"] == {"all_gather": 500}
    assert set(second["comm"]) == {"all_reduce"}  # the late one's time is where it completed
    recorder.clock.close()
