"""Strategy benchmark: every strategy and composition on one model and 4 ranks, and
what running through labkit costs against torchrun.

    ./lab bench strategies [--steps 12] [--repeats 3]

Part 1, on the tiny GPT (dim 64, 4 layers, 4 heads, sequence 32, global batch 32):
step time (median over steps, slowest rank), throughput, bytes through collectives
per rank and step (from the mesh's timed process groups), and parameter + gradient +
optimizer bytes on the fullest rank.

Part 2, the overhead: DDP on the MLP 256-1024-256, global batch 64, 4 ranks with
one thread each, the same training loop (``labkit.rank.loop.train``) run in the lab
and under ``torchrun --standalone``, ``--repeats`` times, alternating which goes
first; the ratio of median step times. Writes bench/results/strategies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit import Lab
from labkit.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "strategies.json"
GPT = dict(dim=64, heads=4, layers=4, seq=32, vocab=64)
RUNS = [
    # name, strategy, mesh, extra settings
    ("ddp", "ddp", None, {}),
    ("fsdp", "fsdp", None, {}),
    ("fsdp (no reshard)", "fsdp", None, dict(reshard_after_forward=False)),
    ("tp", "tp", None, {}),
    ("tp + sequence parallel", "tp", None, dict(sequence_parallel=True)),
    ("pp gpipe", "pp", None, dict(schedule="gpipe", micro_batches=8)),
    ("pp 1f1b", "pp", None, dict(schedule="1f1b", micro_batches=8)),
    ("fsdp+tp dp=2 tp=2", "fsdp+tp", dict(dp=2, tp=2), {}),
    ("ddp+tp dp=2 tp=2", "ddp+tp", dict(dp=2, tp=2), {}),
    ("ddp+pp dp=2 pp=2", "ddp+pp", dict(dp=2, pp=2), dict(micro_batches=4)),
    ("fsdp+pp dp=2 pp=2", "fsdp+pp", dict(dp=2, pp=2), dict(micro_batches=4)),
    ("pp+tp pp=2 tp=2", "pp+tp", dict(pp=2, tp=2), dict(micro_batches=4)),
]
OVERHEAD = dict(strategy="ddp", model="mlp", global_batch=64, model_settings=dict(dims=(256, 1024, 256)))

TORCHRUN_SCRIPT = """
import json, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
from labkit.rank.loop import ScriptContext, train
from labkit.spec.train_config import resolve
settings = json.loads(sys.argv[1])
config = resolve(dist.get_world_size(), **settings)
result = train(config, ScriptContext())
times = [None] * dist.get_world_size()
dist.all_gather_object(times, result["step_seconds"])
if dist.get_rank() == 0:
    slowest = [max(rank_times[step] for rank_times in times) for step in range(config.steps)]
    kept = slowest[1:]
    print(json.dumps({"median_step_seconds": sorted(kept)[len(kept) // 2] if len(kept) % 2 else
                      (sorted(kept)[len(kept) // 2 - 1] + sorted(kept)[len(kept) // 2]) / 2}))
dist.destroy_process_group()
"""


def strategy_table(lab: Lab, steps: int) -> list[dict]:
    rows = []
    for name, strategy, mesh, extra in RUNS:
        report = lab.train(strategy, "gpt", steps=steps, mesh=mesh, global_batch=32, model_settings=GPT,
                           log_every=10**9, **extra)
        row = {
            "name": name,
            "step_ms": report.median_step_seconds * 1000,
            "samples_per_s": report.samples_per_second,
            "tokens_per_s": report.tokens_per_second,
            "comm_bytes_per_rank": report.comm_bytes_per_rank,
            "comm_by_kind": report.comm_bytes_per_step,
            "memory_bytes_max_rank": report.max_memory_bytes,
            "final_loss": report.losses[-1],
        }
        rows.append(row)
        print(f"{name:<22} {row['step_ms']:>8.1f} ms  {row['tokens_per_s']:>9,.0f} tok/s  "
              f"{format_bytes(row['comm_bytes_per_rank']):>9}/step  {format_bytes(row['memory_bytes_max_rank']):>9}",
              flush=True)
    return rows


def _torchrun_step_seconds(script: Path, settings: dict, env: dict) -> float:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node=4", str(script), json.dumps(settings)]
    for attempt in range(3):  # --standalone picks a free port; a rare clash fails the whole run
        finished = subprocess.run(command, capture_output=True, text=True, env=env)
        if finished.returncode == 0:
            return json.loads(finished.stdout.strip().splitlines()[-1])["median_step_seconds"]
        print(f"torchrun failed (attempt {attempt + 1}): {finished.stderr.strip().splitlines()[-1:]}", flush=True)
    raise RuntimeError("torchrun failed three times")


def overhead(lab: Lab, steps: int, repeats: int) -> dict:
    """Median step time in the lab and under torchrun, alternating which runs first.

    On this machine the second of two back-to-back runs is measurably slower
    whichever it is, so the order alternates and the medians are compared.
    """
    settings = dict(OVERHEAD, steps=steps, log_every=10**9)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    in_lab, under_torchrun = [], []
    lab.train(**dict(settings, steps=5))  # warm the ranks' imports and allocator
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch, "ddp_loop.py")
        script.write_text(TORCHRUN_SCRIPT)
        for repeat in range(repeats):
            if repeat % 2:
                under_torchrun.append(_torchrun_step_seconds(script, settings, env))
                in_lab.append(lab.train(**settings).median_step_seconds)
            else:
                in_lab.append(lab.train(**settings).median_step_seconds)
                under_torchrun.append(_torchrun_step_seconds(script, settings, env))
            print(f"overhead repeat {repeat + 1}/{repeats}: lab {in_lab[-1] * 1000:.2f} ms, "
                  f"torchrun {under_torchrun[-1] * 1000:.2f} ms", flush=True)
    lab_ms, torchrun_ms = statistics.median(in_lab) * 1000, statistics.median(under_torchrun) * 1000
    paired = [lab / torchrun for lab, torchrun in zip(in_lab, under_torchrun)]
    return {"lab_ms": lab_ms, "torchrun_ms": torchrun_ms, "ratio": lab_ms / torchrun_ms,
            "ratio_of_best_runs": min(in_lab) / min(under_torchrun),
            "median_paired_ratio": statistics.median(paired),
            "paired_ratio_range": [min(paired), max(paired)],
            "lab_samples_ms": [t * 1000 for t in in_lab], "torchrun_samples_ms": [t * 1000 for t in under_torchrun]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--overhead-steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=8)
    options = parser.parse_args()
    began = time.time()
    with Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=900) as lab:
        print(f"{'strategy (gpt, 4 ranks)':<22} {'step':>11}  {'throughput':>15}  {'comm/rank':>14}  {'memory':>9}")
        rows = strategy_table(lab, options.steps)
        cost = overhead(lab, options.overhead_steps, options.repeats)
    print(f"\nDDP, MLP 256-1024-256, batch 64, 4 ranks x 1 thread: lab {cost['lab_ms']:.2f} ms/step, "
          f"torchrun {cost['torchrun_ms']:.2f} ms/step, ratio of medians {cost['ratio']:.3f} (target <= 1.03); "
          f"best runs {cost['ratio_of_best_runs']:.3f}; paired runs: median {cost['median_paired_ratio']:.3f}, "
          f"range {cost['paired_ratio_range'][0]:.3f}-{cost['paired_ratio_range'][1]:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(), "seconds": time.time() - began,
        "gpt": GPT, "strategies": rows, "overhead": cost,
    }, indent=2))
    print(f"wrote {RESULTS.name}")


if __name__ == "__main__":
    main()
