"""Live metrics in the notebook: merging published windows, derived series, straggler scores."""

import random

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


def test_a_slow_rank_is_flagged_and_a_noisy_clean_run_is_not():
    noise = random.Random(0)
    busy = {rank: [0.02 * (1 + noise.uniform(-0.25, 0.25)) for _ in range(40)] for rank in range(4)}
    assert not any(flagged for _, flagged in straggler_scores(busy, {}).values())
    busy[2] = busy[2][:35] + [0.05] * 5  # slow for its last 5 steps
    scores = straggler_scores(busy, {})
    assert scores[2][1] and scores[2][0] > 2
    assert [rank for rank, (_, flagged) in scores.items() if flagged] == [2]


def test_flagged_within_a_few_steps_of_becoming_slow():
    busy = {rank: [0.02] * 20 for rank in range(4)}
    for steps_slow in range(1, 10):
        trial = {rank: list(times) for rank, times in busy.items()}
        trial[1] += [0.06] * steps_slow
        for rank in (0, 2, 3):
            trial[rank] += [0.02] * steps_slow
        if straggler_scores(trial, {})[1][1]:
            break
    assert steps_slow <= 3  # the median of the last 5 turns after 3 slow steps


def test_ranks_compare_only_with_their_pipeline_stage():
    busy = {0: [0.05] * 10, 1: [0.05] * 10, 2: [0.01] * 10, 3: [0.01] * 10}
    by_stage = {0: 0, 1: 0, 2: 1, 3: 1}  # stage 0 does 5x the work of stage 1, by design
    assert not any(flagged for _, flagged in straggler_scores(busy, by_stage).values())
    alone = straggler_scores({0: [0.05] * 10, 1: [0.01] * 10}, {0: 0, 1: 1})
    assert alone == {0: (1.0, False), 1: (1.0, False)}
    assert straggler_scores({0: [0.01] * 3, 1: [0.05] * 3}, {}) == {0: (1.0, False), 1: (1.0, False)}


def test_bytes_per_rank_show_who_carries_the_traffic():
    table = MetricsTable(3, global_batch=16)
    for step in range(4):
        table.merge_rows([row(0, step, sent={"send": 3000, "recv": 3000}), row(1, step, sent={"send": 1000,
                          "recv": 1000}), row(2, step, sent={"send": 1000, "recv": 1000})])
    assert table.bytes_per_rank() == {0: 6000, 1: 2000, 2: 2000}
