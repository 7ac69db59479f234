"""Stragglers on 4 real gloo ranks: a slowed rank is flagged within 10 steps, a clean run never,
and a straggler threshold outside its range is refused before anything starts."""

import math
import time

import pytest

from labkit import LabConfigError

pytestmark = pytest.mark.lab

CLEAN_STEPS = 200
SLOWDOWN = 0.025  # seconds of busy-waiting per step on the slowed rank


def wait_for(condition, run, what: str, seconds: float = 240.0) -> None:
    """Poll the live table until ``condition()``; fail saying ``what`` if the run ended or it never came."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert not run.done, f"the run ended while waiting for {what}: {run.status()}"
        assert time.monotonic() < deadline, f"no {what} after {seconds:g} s: {run.status()}"
        time.sleep(0.05)


def test_a_clean_run_is_never_flagged_and_a_slowed_rank_is_within_10_steps(lab):
    # A run without end, stopped below: its limit is the waits' (the lab's 30 s is for one cell, and a busy
    # machine can take longer to reach the clean steps and the flag).
    run = lab.train("ddp", "mlp", steps=100_000, background=True, log_every=10**9, timeout=600)
    try:
        wait_for(lambda: (run.table.latest_step or 0) >= CLEAN_STEPS, run, f"{CLEAN_STEPS} steps")
        assert run.table.flag_events() == [], "a clean run must never flag a rank"
        lab.slow(1, SLOWDOWN)
        wait_for(lambda: any(flagged for _, _, flagged in run.table.flag_events()), run, "flag")
        slowed_at = next(step for rank, step, delay in run.table.slow_events() if rank == 1 and delay > 0)
        (rank, flagged_at, _), *_ = [event for event in run.table.flag_events() if event[2]]
        # Counted on the rows: from the first step the slowdown took, to the step whose rows flagged it.
        assert rank == 1 and flagged_at - slowed_at <= 10, (slowed_at, run.table.flag_events())
        print(f"flagged {flagged_at - slowed_at} steps after the slowdown")
    finally:
        lab.slow(1, None)
        run.stop()
    run.wait()


@pytest.mark.parametrize("threshold", [-1, 0, 1, 1.0, math.nan, math.inf, 1e9, True, "1.5"])
def test_a_straggler_threshold_out_of_range_is_refused_before_anything_starts(lab, threshold):
    with pytest.raises(LabConfigError, match="above 1 and at most 10"):
        lab.train("ddp", "mlp", steps=1, straggler_threshold=threshold)
    assert "training" not in str(lab.status())
    assert lab.train("ddp", "mlp", steps=1, straggler_threshold=2).steps_done == 1
