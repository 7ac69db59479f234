"""LoopReport: the numbers of a watched foreign loop, from made-up rows (pure, no processes)."""

import math

import pytest

from labkit.views.loop_report import LoopReport
from tests.unit.views.test_train_report import row


def result(rank, rows, memory=None, notes=()):
    return {"rank": rank, "rows": rows, "timeline": [], "memory": memory or {"params": 10, "grads": 10,
                                                                               "optimizer": 20},
            "steps_done": len(rows), "notes": list(notes), "found": "DistributedDataParallel", "stopped": False}


def test_steps_speed_and_bytes_come_from_every_ranks_rows():
    # Rank 1 did one step more than rank 0 (stopped at another boundary): only common steps count.
    slow = [row(0, step, 0.2 if step == 0 else 0.05, 0.04, {"all_reduce": 400}, samples=16) for step in range(4)]
    fast = [row(1, step, 0.04, 0.03, {"all_reduce": 400, "broadcast": 8}, samples=16, tokens=160)
            for step in range(5)]
    report = LoopReport("train.py --epochs 1", [result(0, slow), result(1, fast)])
    assert report.steps_done == 4
    assert report.step_seconds == [0.2, 0.05, 0.05, 0.05]
    assert report.median_step_seconds == 0.05  # the first step warms up and is left out
    assert report.samples_per_step == 32
    assert report.samples_per_second == pytest.approx(32 / 0.05)
    assert report.tokens_per_second == pytest.approx(160 / 0.05)  # only the rank that counted tokens
    assert report.comm_bytes_per_step == {"all_reduce": 800, "broadcast": 8}
    assert report.losses == [1.0] * 4
    assert "4 steps" in str(report) and "all_reduce" in str(report)


def test_a_loop_without_steps_or_samples_says_so():
    report = LoopReport("cell", [result(0, [], notes=["no DDP or FSDP module ran a forward"]), result(1, [])])
    assert report.steps_done == 0 and math.isnan(report.median_step_seconds)
    assert report.samples_per_second == 0.0 and report.tokens_per_second is None
    assert report.notes == ["no DDP or FSDP module ran a forward"]
    with pytest.raises(ValueError, match="labkit.step"):
        report.timeline()
    assert "0 steps" in str(report)


def test_a_straggler_is_flagged_from_busy_time():
    ranks = [[row(rank, step, 0.05, 0.045 if rank == 2 else 0.015, {}, samples=4) for step in range(30)]
             for rank in range(4)]
    report = LoopReport("cell", [result(rank, rows) for rank, rows in enumerate(ranks)])
    assert report.flagged == [2]
    assert "stragglers: rank 2" in str(report)
