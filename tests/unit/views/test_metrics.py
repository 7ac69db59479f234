"""Live metrics in the notebook: merging published windows, derived series, straggler scores."""

import math
import random

import pytest

from labkit.views.metrics import MetricsTable, straggler_scores


def row(rank, step, compute=0.01, seconds=0.03, delay=0.0, loss=1.0, comm=None, sent=None):
    return {"rank": rank, "step": step, "start": step * seconds, "seconds": seconds, "compute": compute,
            "exposed_comm": seconds - compute, "comm": comm or {"all_reduce": 0.02},
            "bytes": sent or {"all_reduce": 1000}, "samples": 8, "tokens": None, "loss": loss, "delay": delay}


def test_windows_merge_into_one_row_per_step():
    table = MetricsTable(2, global_batch=16)
    assert table.merge({"rank": 0, "seq": 1, "rows": [row(0, 0), row(0, 1)]}) == 2
    assert table.merge({"rank": 0, "seq": 2, "rows": [row(0, 1), row(0, 2)]}) == 1  # overlap: one new
    assert table.merge({"rank": 0, "seq": 2, "rows": [row(0, 3)]}) == 0  # same sequence: already seen
    assert table.merge({"rank": 0, "seq": 1, "rows": [row(0, 4)]}) == 0  # older window arriving late
    assert table.merge(None) == 0
    assert sorted(table.rows[0]) == [0, 1, 2]
    assert table.latest_step is None  # rank 1 has reported nothing yet
    table.merge({"rank": 1, "seq": 1, "rows": [row(1, 0), row(1, 1)]})
    assert table.latest_step == 1


def test_derived_series():
    table = MetricsTable(2, global_batch=16)
    for step in range(6):
        table.merge_rows([row(0, step, seconds=0.04, loss=2.0), row(1, step, seconds=0.02, loss=4.0)])
    assert table.total_throughput() == 16 / 0.04  # the slowest rank sets the step
    steps, values = table.throughput(1)
    assert steps == list(range(6)) and values[0] == 8 / 0.02
    assert table.loss() == (list(range(6)), [3.0] * 6)
    compute, waiting = table.split()[0]
    assert round(compute, 6) == 0.01 and round(waiting, 6) == 0.03
    seconds, size = table.by_collective()["all_reduce"]
    assert round(seconds, 6) == 0.04 and size == 2000


def test_slow_events_mark_where_a_delay_starts_and_ends():
    table = MetricsTable(2, global_batch=16)
    for step in range(8):
        table.merge_rows([row(0, step), row(1, step, delay=0.03 if 3 <= step < 6 else 0.0)])
    assert table.slow_events() == [(1, 3, 0.03), (1, 6, 0.0)]


def machine(seed, ranks=4, spread=0.06, bursts=True):
    """Busy seconds per step as a shared two-core machine gives them: each step about 6% off its rank's
    usual 8 ms (log-normal), and now and then a burst of 8-14 steps 35% busier on one rank (another
    tenant on its core), as measured on clean 4-rank DDP runs. Returns step -> {rank: seconds}."""
    noise = random.Random(seed)
    burst_until = {rank: -1 for rank in range(ranks)}

    def step(index):
        values = {}
        for rank in range(ranks):
            if bursts and index > burst_until[rank] and noise.random() < 0.002:
                burst_until[rank] = index + noise.randint(8, 14)
            factor = 1.35 if index <= burst_until[rank] else 1.0
            values[rank] = 0.008 * factor * math.exp(noise.gauss(0.0, spread))
        return values

    return step


def steps_to_flag(step_of, slow_from=None, factor=1.0, steps=200, rank=1):
    """Feed a table step by step (rank ``rank`` ``factor`` x busier from ``slow_from``); the first
    flag as (rank, steps after the slowdown began), or None."""
    table = MetricsTable(4, global_batch=32)
    for index in range(steps):
        busy = step_of(index)
        if slow_from is not None and index >= slow_from:
            busy[rank] *= factor
        table.merge_rows([row(r, index, compute=busy[r]) for r in busy])
        flagged = table.flagged()
        if flagged:
            return flagged[0], index - (slow_from or 0)
    return None


@pytest.mark.parametrize("seed", range(30))
def test_a_clean_run_of_200_steps_on_a_loaded_machine_is_never_flagged(seed):
    assert steps_to_flag(machine(seed)) is None


@pytest.mark.parametrize("seed", range(30))
def test_busy_time_risen_20_percent_is_flagged_within_10_steps(seed):
    quiet = machine(seed, spread=0.015, bursts=False)  # one rank's own work, nothing else on its core
    assert steps_to_flag(quiet) is None
    rank, after = steps_to_flag(quiet, slow_from=60, factor=1.2)
    assert rank == 1 and after < 10


@pytest.mark.parametrize("seed", range(30))
def test_a_rank_slowed_25ms_on_a_loaded_machine_is_flagged_within_10_steps(seed):
    # 25 ms of busy-waiting on a core shared with 4 others counts about 6 ms of CPU time against 8.
    rank, after = steps_to_flag(machine(seed), slow_from=60, factor=1.75)
    assert rank == 1 and after < 10


def test_a_flag_holds_while_the_score_hovers_and_clears_once_it_is_back():
    busy = {rank: [0.01] * 40 for rank in range(4)}
    busy[2] = [0.01] * 10 + [0.013] * 10 + [0.0112] * 10 + [0.01] * 10  # 30% busier, then 12%, then as the others
    flags = [straggler_scores({r: values[: n + 1] for r, values in busy.items()}, {})[2][1] for n in range(40)]
    became, cleared = flags.index(True), flags.index(False, flags.index(True))
    assert 10 <= became < 20, "flagged while 30% busier"
    assert cleared >= 30, "12% busier is under the threshold but over its release: the flag holds"
    assert cleared < 30 + 8 and not any(flags[cleared:]), "back to normal: cleared within a window, for good"


def test_rows_arriving_late_or_missing_give_the_same_flags():
    step_of = machine(3)
    steps = [step_of(index) for index in range(120)]
    for index in range(60, 120):
        steps[index][1] *= 1.75
    at_once = MetricsTable(4, global_batch=32)
    at_once.merge_rows([row(r, index, compute=busy[r]) for index, busy in enumerate(steps) for r in busy])
    windows = MetricsTable(4, global_batch=32)
    for end in range(10, 121, 10):  # each rank publishes its newest rows in windows, at its own pace
        for rank in range(4):
            newest = end - 3 * rank if end < 120 else end
            windows.merge({"rank": rank, "seq": end, "rows": [row(rank, index, compute=steps[index][rank])
                                                               for index in range(max(0, newest - 12), newest)
                                                               if index != 33]})  # one step never arrives
        windows.flagged()
    assert at_once.flagged() == windows.flagged() == [1]
    (rank, step, flagged), = [event for event in windows.flag_events() if event[2]]
    assert rank == 1 and 60 <= step < 70


def test_ranks_compare_only_with_their_pipeline_stage():
    busy = {0: [0.05] * 10, 1: [0.05] * 10, 2: [0.01] * 10, 3: [0.01] * 10}
    by_stage = {0: 0, 1: 0, 2: 1, 3: 1}  # stage 0 does 5x the work of stage 1, by design
    assert not any(flagged for _, flagged in straggler_scores(busy, by_stage).values())
    alone = straggler_scores({0: [0.05] * 10, 1: [0.01] * 10}, {0: 0, 1: 1})
    assert alone == {0: (1.0, False), 1: (1.0, False)}
    assert straggler_scores({0: [0.01] * 3, 1: [0.05] * 3}, {}) == {0: (1.0, False), 1: (1.0, False)}  # too few steps
    assert straggler_scores({0: [0.01] * 4, 1: [0.05] * 4}, {})[1] == (5.0, True)


def test_bytes_per_rank_show_who_carries_the_traffic():
    table = MetricsTable(3, global_batch=16)
    for step in range(4):
        table.merge_rows([row(0, step, sent={"send": 3000, "recv": 3000}), row(1, step, sent={"send": 1000,
                          "recv": 1000}), row(2, step, sent={"send": 1000, "recv": 1000})])
    assert table.bytes_per_rank() == {0: 6000, 1: 2000, 2: 2000}


def test_a_loop_without_a_global_batch_counts_its_samples_and_says_its_memory():
    table = MetricsTable(2, global_batch=None)
    assert table.largest_memory() is None
    table.merge({"rank": 0, "seq": 1, "rows": [row(0, step) for step in range(4)],
                 "memory": {"params": 100, "grads": 100, "optimizer": 200}})
    table.merge({"rank": 1, "seq": 1, "rows": [row(1, step) for step in range(4)],
                 "memory": {"params": 300, "grads": 0, "optimizer": 0}})
    assert table.largest_memory() == 400
    assert table.total_throughput() == pytest.approx(16 / 0.03)  # 8 samples on each rank per 30 ms step
