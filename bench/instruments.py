"""Instrument benchmark: are the measurements right, and what do they cost?

    ./lab bench instruments [--repeats 8]

Accuracy: on 4 ranks, loops of blocking all-reduces over an instrumented mesh
group, each step's reported communication time (issue to completion, from the
timed process group) against the same collectives timed directly around each
call, and the reported exposed communication against the step's wall time
(a loop that only communicates should be all exposed). Target: within 15%.

Cost: DDP on the MLP 256-1024-256, global batch 64, 4 ranks with one thread
each, trained with instruments and the live dashboard (drawn in this process,
in the background, as in a notebook) against the same loop with
``instruments=False``, alternating which goes first; ratio of median step
times. Target: at most 1.03.

Detection: DDP on the zoo's MLP with the defaults, in the background; after 200
clean steps (any flag there is a false one), rank 1 is slowed by a fixed delay
(25 ms) and, in another repeat, by 20% of its own busy time over those clean
steps; the steps from the slowdown's first step to the step whose rows flag it,
counted on the rows. Target: within 10 steps, and no false flag.

Writes bench/results/instruments.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from labkit import Lab

RESULTS = Path(__file__).resolve().parent / "results" / "instruments.json"
MLP = dict(strategy="ddp", model="mlp", global_batch=64, model_settings=dict(dims=(256, 1024, 256)))


def all_reduce_loop(sizes, count):
    """Rank side: per size, (reported comm, direct comm, reported exposed, step wall) in seconds."""
    import time as clock

    import torch
    import torch.distributed as dist

    from labkit import this_rank

    runtime = this_rank()
    group = runtime.mesh_for((dist.get_world_size(),), ("dp",)).get_group()  # instrumented
    recorder = runtime.recorder
    results = []
    for index, size in enumerate(sizes):
        tensor = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(tensor, group=group)
        dist.barrier()
        recorder.begin_step(index)
        direct = 0.0
        for _ in range(count):
            began = clock.perf_counter()
            dist.all_reduce(tensor, group=group)
            direct += clock.perf_counter() - began
        row = recorder.end_step(0, None, None)
        results.append((row["comm"]["all_reduce"], direct, row["exposed_comm"], row["seconds"]))
    return results


def accuracy(lab: Lab, sizes, count: int) -> list[dict]:
    per_rank = lab.run(all_reduce_loop, sizes, count)
    rows = []
    for index, size in enumerate(sizes):
        reported = statistics.fmean(rank[index][0] for rank in per_rank)
        direct = statistics.fmean(rank[index][1] for rank in per_rank)
        exposed = statistics.fmean(rank[index][2] for rank in per_rank)
        wall = statistics.fmean(rank[index][3] for rank in per_rank)
        rows.append({"bytes": size, "count": count, "reported_comm_s": reported, "direct_comm_s": direct,
                     "comm_ratio": reported / direct, "exposed_s": exposed, "wall_s": wall,
                     "exposed_ratio": exposed / wall})
    return rows


def cost(lab: Lab, steps: int, repeats: int) -> dict:
    plain, instrumented, draws, render = [], [], [], []
    lab.train(**MLP, steps=5, log_every=10**9)  # warm up
    for repeat in range(repeats):
        order = ("plain", "instrumented") if repeat % 2 == 0 else ("instrumented", "plain")
        for kind in order:
            if kind == "plain":
                plain.append(lab.train(**MLP, steps=steps, instruments=False, log_every=10**9).median_step_seconds)
            else:
                run = lab.train(**MLP, steps=steps, dashboard=True, background=True, log_every=10**9)
                instrumented.append(run.wait().median_step_seconds)
                draws.append(run.dashboard.draws)
                render.append(run.dashboard.render_seconds / max(1, run.dashboard.draws))
        print(f"cost repeat {repeat + 1}/{repeats}: without {plain[-1] * 1000:.2f} ms, "
              f"with instruments + dashboard {instrumented[-1] * 1000:.2f} ms ({draws[-1]} redraws)", flush=True)
    paired = [i / p for i, p in zip(instrumented, plain)]
    return {
        "plain_ms": statistics.median(plain) * 1000,
        "instrumented_ms": statistics.median(instrumented) * 1000,
        "ratio": statistics.median(instrumented) / statistics.median(plain),
        "median_paired_ratio": statistics.median(paired),
        "paired_ratio_range": [min(paired), max(paired)],
        "redraws_per_run": statistics.median(draws),
        "render_ms_per_redraw": statistics.median(render) * 1000,
        "plain_samples_ms": [t * 1000 for t in plain],
        "instrumented_samples_ms": [t * 1000 for t in instrumented],
    }


def steps_to_flag(lab, delay_of, clean_steps: int = 200, give_up_steps: int = 60) -> dict:
    """One detection trial: false flags over ``clean_steps``, then rank 1 slowed by ``delay_of(busy)`` seconds
    (``busy``: its median CPU busy time per clean step); steps until flagged (None: not within ``give_up_steps``)."""
    run = lab.train("ddp", "mlp", steps=100_000, background=True, log_every=10**9)
    try:
        while (run.table.latest_step or 0) < clean_steps:
            assert not run.done, run.status()
            time.sleep(0.05)
        false_flags = len([event for event in run.table.flag_events() if event[2]])
        busy = statistics.median(run.table.series(1, "cpu", last=clean_steps)[1])
        delay = delay_of(busy)
        lab.slow(1, delay)
        slowed_at = flagged_at = None
        while flagged_at is None:
            slowed = [step for rank, step, seconds in run.table.slow_events() if rank == 1 and seconds > 0]
            slowed_at = slowed[0] if slowed else None
            flags = [step for rank, step, up in run.table.flag_events() if rank == 1 and up]
            if flags and slowed_at is not None:
                flagged_at = flags[0]
            elif slowed_at is not None and (run.table.latest_step or 0) > slowed_at + give_up_steps:
                break
            time.sleep(0.05)
    finally:
        lab.slow(1, None)
        run.stop()
    run.wait()
    return {"delay_ms": delay * 1000, "busy_ms": busy * 1000, "false_flags": false_flags,
            "steps_to_flag": None if flagged_at is None else flagged_at - slowed_at}


def detection(lab, repeats: int) -> dict:
    trials = {"25 ms": [], "20% of busy": []}
    for _ in range(repeats):
        trials["25 ms"].append(steps_to_flag(lab, lambda busy: 0.025))
        trials["20% of busy"].append(steps_to_flag(lab, lambda busy: 0.2 * busy))
        for name, done in trials.items():
            print(f"detection, {name}: {done[-1]}", flush=True)
    return trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--count", type=int, default=40, help="all-reduces per accuracy step")
    parser.add_argument("--detection-repeats", type=int, default=3)
    options = parser.parse_args()
    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20]
    with Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=900) as lab:
        rows = accuracy(lab, sizes, options.count)
        print(f"{'message':>9}  {'reported':>9}  {'direct':>9}  {'ratio':>6}  {'exposed/wall':>12}")
        for row in rows:
            print(f"{row['bytes'] / 1024:>6.0f} KiB  {row['reported_comm_s'] * 1000:>7.1f} ms  "
                  f"{row['direct_comm_s'] * 1000:>7.1f} ms  {row['comm_ratio']:>6.3f}  {row['exposed_ratio']:>12.3f}")
        spent = cost(lab, options.steps, options.repeats)
        found = detection(lab, options.detection_repeats)
    worst = max(abs(row["comm_ratio"] - 1) for row in rows)
    print(f"\ncommunication time, reported against direct: worst {worst:.1%} off (target within 15%)")
    print(f"DDP step: without instruments {spent['plain_ms']:.2f} ms, with instruments and live dashboard "
          f"{spent['instrumented_ms']:.2f} ms: ratio of medians {spent['ratio']:.3f} (target <= 1.03); paired runs "
          f"median {spent['median_paired_ratio']:.3f}, range {spent['paired_ratio_range'][0]:.3f}-"
          f"{spent['paired_ratio_range'][1]:.3f}; dashboard {spent['render_ms_per_redraw']:.1f} ms per redraw")
    for name, done in found.items():
        steps = [trial["steps_to_flag"] for trial in done]
        print(f"straggler slowed by {name} (target: flagged within 10 steps): steps to flag {steps}; "
              f"false flags over 200 clean steps: {sum(trial['false_flags'] for trial in done)}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(),
                                   "accuracy": rows, "cost": spent, "detection": found}, indent=2))
    print(f"wrote {RESULTS.name}")


if __name__ == "__main__":
    main()
