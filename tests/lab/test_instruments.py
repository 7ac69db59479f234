"""Instruments on 4 real gloo ranks: rows, bytes, timelines, stragglers, stopping, dashboards."""

import json
import os
import signal
import threading
import time

import pytest

from labkit import LabBusy

pytestmark = pytest.mark.lab

MLP = dict(dims=(16, 64, 64, 64, 16))
PARAM_BYTES = 4 * (16 * 64 + 64 + 64 * 64 + 64 + 64 * 64 + 64 + 64 * 16 + 16)


def steady_rows(report):
    return [result["rows"][1:] for result in report.results]


def test_every_step_is_split_into_compute_and_exposed_communication(lab):
    report = lab.train("ddp", "mlp", steps=5, model_settings=MLP, global_batch=16, log_every=100)
    for result, rows in zip(report.results, steady_rows(report)):
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for r in rows:
            assert r["compute"] > 0  # the main thread ran forward and backward: its busy time was seen
            assert r["comm"]["all_reduce"] > 0 and r["samples"] == 4 and r["loss"] is not None
        # The rows span the steps the loop timed on its own clock (StepTimer), not some other interval.
        assert sum(r["seconds"] for r in rows) == pytest.approx(sum(result["step_seconds"][1:]), rel=0.25, abs=0.005)
    # The split is measured, not assumed: a peer slowed by 40 ms (busy, as a slow device is) is compute
    # on that rank, and shows on the others as time blocked in the all-reduce that waits for it.
    lab.slow(1, 0.04)
    try:
        slowed = lab.train("ddp", "mlp", steps=4, model_settings=MLP, global_batch=16, log_every=100)
    finally:
        lab.slow(1, None)
    compute, exposed = {}, {}
    for rank, rows in enumerate(steady_rows(slowed)):
        assert {r["delay"] for r in rows} == ({0.04} if rank == 1 else {0.0})
        compute[rank] = sum(r["compute"] for r in rows) / len(rows)
        exposed[rank] = sum(r["exposed_comm"] for r in rows) / len(rows)
    others = [0, 2, 3]
    for rank in others:
        assert exposed[rank] >= 0.02 and compute[rank] < 0.02, (rank, compute, exposed)
    # Busy time is CPU time (plus run delay where the kernel reports it): on a loaded machine the
    # slowed rank may get only part of a core for its 40 ms, but far more than a waiting rank.
    assert compute[1] > 2 * max(compute[rank] for rank in others), (compute, exposed)


def test_bytes_per_collective_kind_match_the_strategy(lab):
    ddp = lab.train("ddp", "mlp", steps=4, model_settings=MLP, global_batch=16, log_every=100)
    for rows in steady_rows(ddp):
        assert {r["bytes"]["all_reduce"] for r in rows} == {PARAM_BYTES}  # DDP all-reduces every gradient once
    fsdp = lab.train("fsdp", "mlp", steps=4, model_settings=MLP, global_batch=16, log_every=100)
    for rows in steady_rows(fsdp):
        for r in rows:
            # Gathered for forward and again for backward; gradients reduce-scattered once.
            assert r["bytes"] == {"all_gather": 2 * PARAM_BYTES, "reduce_scatter": PARAM_BYTES}
    pp = lab.train("pp", "mlp", steps=4, model_settings=MLP, global_batch=16, micro_batches=4, log_every=100)
    first_stage = steady_rows(pp)[0]
    # Stage 0 sends 16 activations of width 64 forward and receives their gradients back.
    assert {r["bytes"]["send"] for r in first_stage} == {16 * 64 * 4}
    assert {r["bytes"]["recv"] for r in first_stage} == {16 * 64 * 4}


def test_timeline_and_trace_of_the_last_steps(lab, tmp_path):
    report = lab.train("pp", "gpt", steps=4, micro_batches=4, schedule="gpipe", global_batch=16,
                       model_settings=dict(dim=32, heads=4, layers=4, seq=16, vocab=32), log_every=100)
    timeline = report.timeline(steps=2)
    assert sorted(timeline.entries) == [0, 1, 2, 3]
    assert all(len(entries) == 2 for entries in timeline.entries.values())
    assert 0 < timeline.waiting_fraction(3) < 1
    trace = json.load(open(report.export_trace(str(tmp_path / "pp.json"))))
    kinds = {e["name"] for e in trace["traceEvents"] if e["ph"] == "b"}
    assert kinds == {"send", "recv"}
    assert timeline._repr_png_().startswith(b"\x89PNG")


def test_without_instruments_nothing_is_recorded(lab):
    report = lab.train("ddp", "mlp", steps=3, model_settings=MLP, global_batch=16, log_every=100, instruments=False)
    assert all(result["rows"] == [] for result in report.results)
    with pytest.raises(ValueError, match="instruments=False"):
        report.timeline()


def test_a_straggler_is_found_and_a_clean_run_is_not_flagged(lab):
    run = lab.train("ddp", "mlp", steps=100_000, model_settings=MLP, global_batch=16, background=True)
    try:
        false_alarms = set()
        while run.table.latest_step is None or run.table.latest_step < 30:
            false_alarms.update(run.table.flagged())
            time.sleep(0.05)
        assert false_alarms == set(), "a clean run must never flag a rank"
        print(lab.slow(1, 0.04))
        while not run.table.flagged():
            time.sleep(0.05)
        assert run.table.flagged() == [1]
        (rank, slowed_at, delay), = run.table.slow_events()
        assert (rank, delay) == (1, 0.04)
        assert run.table.latest_step - slowed_at <= 10
        with pytest.raises(LabBusy, match="run.wait"):
            lab.run(lambda: 1)
        assert "training" in str(lab.status())
    finally:
        lab.slow(1, None)
        run.stop()
    report = run.wait()
    assert report.stopped_early and len({result["steps_done"] for result in report.results}) == 1
    assert lab.run(lambda: 2) == [2, 2, 2, 2]


def test_background_dashboard_redraws_while_training(lab):
    run = lab.train("ddp", "mlp", steps=100_000, model_settings=MLP, global_batch=16, dashboard=True,
                    background=True)
    try:
        while run.table.latest_step is None or run.table.latest_step < 5:
            time.sleep(0.05)
        first_draws, first_picture = run.dashboard.draws, run.dashboard.image.value
        # It keeps redrawing while the run trains; how fast is bench/instruments.py's to measure, not a test's.
        deadline = time.monotonic() + 20
        while run.dashboard.draws < first_draws + 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run.dashboard.draws >= first_draws + 4
        assert run.dashboard.image.value != first_picture
        assert "samples/s" in run.dashboard.header.value
    finally:
        run.stop()
        run.wait()  # also after a failed check: the next test needs the lab idle
    assert run.dashboard.stop_button.description == "Done"


def test_interrupting_a_training_cell_stops_at_a_step_boundary(lab):
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    report = lab.train("ddp", "mlp", steps=100_000, model_settings=MLP, global_batch=16, log_every=10**6)
    assert report.stopped_early and report.steps_done > 0
    assert lab.run(lambda: 3) == [3, 3, 3, 3]


def test_collective_benchmark(lab):
    bench = lab.bench_collective("allreduce", sizes=[1024, 65536], iterations=5)
    assert bench.operation == "all_reduce" and bench.sizes == [1024, 65536]
    assert all(seconds > 0 for seconds in bench.seconds) and bench.memcpy > 1e8
    for size, seconds, algbw, busbw in bench.rows():
        assert algbw == pytest.approx(size / seconds)  # algorithm bandwidth: the message over the slowest rank's time
        assert busbw == pytest.approx(1.5 * algbw)  # nccl-tests' all-reduce bus factor 2(n-1)/n, n = 4
    with pytest.raises(ValueError, match="unknown collective"):
        lab.bench_collective("alltoallv")
