"""Instruments on loops the lab did not write: what they cost, how fast they catch a straggler, and
whether their steps are the loop's own.

    ./lab bench any_loop [--repeats 5] [--epochs 40]

On 4 gloo ranks with one thread each, in one run:

- **Cost on an unmodified DDP trainer** (the workshop's tutorial-style script, argparse and a
  Trainer class): ``lab.run_script`` with and without ``instruments=True``, alternating which
  goes first; each repeat's ratio of the whole script's wall time (its 8 x ``--epochs`` steps
  dominate it), then the median over repeats. Target: at most 1.03.
- **Cost on a hand-written FSDP loop** in a cell (``fully_shard`` per layer, AdamW): the cell
  times its own steps with ``time.perf_counter``; the slowest rank's median step with and
  without instruments, alternating, ratio per repeat, median. Target: at most 1.03.
- **Steps that are the loop's own**: in the watched FSDP runs, each row's seconds against the
  loop's own timing of the same step (rows begin and end at the optimizer's step, the loop's
  timer around zero_grad to step): the median ratio, target within 2%; and compute + exposed
  communication against the row's step (equal by construction, checked).
- **Detection**: the DDP trainer in the background with the dashboard's table, 40 clean
  steps, then rank 2 slowed by 25 ms (``lab.slow``): the steps from the slowdown's first step
  to the step whose rows flag it. Target: within 10 steps.

Writes bench/results/any_loop.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from results_file import write_results

from labkit import Lab

RESULTS = Path(__file__).resolve().parent / "results" / "any_loop.json"
TRAINER = Path(__file__).resolve().parents[1] / "notebooks" / "scripts" / "ddp_trainer.py"

FSDP_LOOP = """
import time
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)])
for block in model:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(rank)
bench_times = []
for step in range(STEPS):
    batch = torch.randn(16, 256, generator=generator)
    began = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()
    bench_times.append(time.perf_counter() - began)
"""


def script_seconds(lab: Lab, epochs: int, instruments: bool) -> float:
    began = time.perf_counter()
    lab.run_script(TRAINER, "--epochs", str(epochs), instruments=instruments)
    return time.perf_counter() - began


def fsdp_loop(lab: Lab, steps: int, instruments: bool) -> tuple[float, list[float], list[float]]:
    """(median step, slowest rank, by the loop's own timer; row seconds / own seconds per step of rank 0;
    compute + exposed against seconds per row of rank 0)."""
    code = FSDP_LOOP.replace("STEPS", str(steps))
    report = lab.run_cell(code, instruments=instruments, live=False)
    own = lab.run(_own_times)
    slowest = [max(times[step] for times in own) for step in range(1, steps)]
    if not instruments:
        return statistics.median(slowest), [], []
    rows = report.rows[0]
    # A row runs from one optimizer step's end to the next: it holds the loop's own step and what the loop
    # did before its timer (the batch drawn); the row of step k ends where the timer of step k ends.
    own_rank0 = own[0]
    ratios = [rows[step]["seconds"] / own_rank0[step] for step in range(1, min(len(rows), steps))]
    split = [(row["compute"] + row["exposed_comm"]) / row["seconds"] for row in rows]
    return statistics.median(slowest), ratios, split


def _own_times() -> list[float]:
    return globals()["bench_times"]  # on the rank: what FSDP_LOOP left in its namespace


def detection(lab: Lab, slow_seconds: float = 0.025, clean_steps: int = 40) -> dict:
    run = lab.run_script(TRAINER, "--epochs", "100000", background=True)
    try:
        while (run.table.latest_step or 0) < clean_steps:
            time.sleep(0.05)
        false_flags = list(run.table.flagged())
        lab.slow(2, slow_seconds)
        deadline = time.monotonic() + 120
        while 2 not in run.table.flagged() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        lab.slow(2, None)
        run.stop()
    report = run.wait()
    first_slow = next(row["step"] for row in report.rows[2] if row["delay"] > 0)
    flagged_at = next((step for rank, step, up in run.table.flag_events() if rank == 2 and up and step >= first_slow),
                      None)
    return {"slow_ms": slow_seconds * 1000, "first_slow_step": first_slow, "flagged_step": flagged_at,
            "steps_to_flag": None if flagged_at is None else flagged_at - first_slow, "false_flags": false_flags}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=40, help="the DDP trainer's epochs (8 steps each)")
    parser.add_argument("--steps", type=int, default=120, help="steps of the FSDP loop")
    args = parser.parse_args()
    with Lab(ranks=4, backend="gloo", threads_per_rank=1) as lab:
        script_seconds(lab, 1, True)  # first use: DDP's, the hooks', the groups' recording
        fsdp_loop(lab, 5, True)
        plain, watched, loop_plain, loop_watched, row_ratios, splits = [], [], [], [], [], []
        for repeat in range(args.repeats):
            for instruments in ((False, True) if repeat % 2 == 0 else (True, False)):
                (watched if instruments else plain).append(script_seconds(lab, args.epochs, instruments))
                median, ratios, split = fsdp_loop(lab, args.steps, instruments)
                (loop_watched if instruments else loop_plain).append(median)
                row_ratios += ratios
                splits += split
        script_ratios = [w / p for w, p in zip(watched, plain)]
        loop_ratios = [w / p for w, p in zip(loop_watched, loop_plain)]
        found = detection(lab)
    results = {
        "ddp_trainer": {"epochs": args.epochs, "plain_seconds": plain, "instrumented_seconds": watched,
                        "ratios": script_ratios, "ratio": statistics.median(script_ratios)},
        "fsdp_loop": {"steps": args.steps, "plain_step_seconds": loop_plain, "instrumented_step_seconds": loop_watched,
                      "ratios": loop_ratios, "ratio": statistics.median(loop_ratios)},
        "rows_against_own_timer": {"median": statistics.median(row_ratios),
                                   "p10": statistics.quantiles(row_ratios, n=10)[0],
                                   "p90": statistics.quantiles(row_ratios, n=10)[-1]},
        "compute_plus_exposed_over_step": {"min": min(splits), "max": max(splits)},
        "detection": found,
        "repeats": args.repeats,
    }
    print(f"DDP trainer, {args.epochs * 8} steps: {statistics.median(plain):.2f} s plain, "
          f"{statistics.median(watched):.2f} s with instruments ({results['ddp_trainer']['ratio']:.3f}x, "
          f"{min(script_ratios):.2f}-{max(script_ratios):.2f})")
    print(f"FSDP loop in a cell: {statistics.median(loop_plain) * 1000:.2f} ms plain, "
          f"{statistics.median(loop_watched) * 1000:.2f} ms with instruments ({results['fsdp_loop']['ratio']:.3f}x, "
          f"{min(loop_ratios):.2f}-{max(loop_ratios):.2f})")
    rows = results["rows_against_own_timer"]
    print(f"a row's step against the loop's own timer: median {rows['median']:.3f} "
          f"(10% {rows['p10']:.3f}, 90% {rows['p90']:.3f}); compute + exposed over step: "
          f"{min(splits):.4f}-{max(splits):.4f}")
    print(f"rank 2 slowed by {found['slow_ms']:.0f} ms at step {found['first_slow_step']}: flagged at step "
          f"{found['flagged_step']} ({found['steps_to_flag']} steps); false flags before: {found['false_flags']}")
    write_results(RESULTS, results)


if __name__ == "__main__":
    main()
