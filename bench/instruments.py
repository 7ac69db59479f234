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
times. Target: at most 1.03. Writes bench/results/instruments.json.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--count", type=int, default=40, help="all-reduces per accuracy step")
    options = parser.parse_args()
    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20]
    with Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=900) as lab:
        rows = accuracy(lab, sizes, options.count)
        print(f"{'message':>9}  {'reported':>9}  {'direct':>9}  {'ratio':>6}  {'exposed/wall':>12}")
        for row in rows:
            print(f"{row['bytes'] / 1024:>6.0f} KiB  {row['reported_comm_s'] * 1000:>7.1f} ms  "
                  f"{row['direct_comm_s'] * 1000:>7.1f} ms  {row['comm_ratio']:>6.3f}  {row['exposed_ratio']:>12.3f}")
        spent = cost(lab, options.steps, options.repeats)
    worst = max(abs(row["comm_ratio"] - 1) for row in rows)
    print(f"\ncommunication time, reported against direct: worst {worst:.1%} off (target within 15%)")
    print(f"DDP step: without instruments {spent['plain_ms']:.2f} ms, with instruments and live dashboard "
          f"{spent['instrumented_ms']:.2f} ms: ratio of medians {spent['ratio']:.3f} (target <= 1.03); paired runs "
          f"median {spent['median_paired_ratio']:.3f}, range {spent['paired_ratio_range'][0]:.3f}-"
          f"{spent['paired_ratio_range'][1]:.3f}; dashboard {spent['render_ms_per_redraw']:.1f} ms per redraw")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(),
                                   "accuracy": rows, "cost": spent}, indent=2))
    print(f"wrote {RESULTS.name}")


if __name__ == "__main__":
    main()
