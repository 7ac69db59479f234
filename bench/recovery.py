"""Recovery benchmark: a rank killed mid-training, until the error is shown and until training goes on.

    ./lab bench recovery [--repeats 3]

On 4 gloo ranks (one thread each), a DDP run of the zoo MLP with a checkpoint every
10 steps; rank 2 is slowed by 30 ms a step so a kill lands mid-step. For each repeat:

  death to error   SIGKILL of rank 1 while a collective is in flight, until ``run.wait()``
                   raises (every rank back, the group rebuilt);
  heal to resumed  ``lab.heal()`` (replace the rank, load the newest checkpoint, start the
                   continuation) until the continuation's first step is done;
  steps lost       the steps finished when the rank died, minus the checkpoint's step;
  one rank start   replacing one rank alone (``RankCluster.replace``), for scale;
  torchrun         ``torchrun --max-restarts 1`` of a DDP script with a checkpoint every 10
                   steps: worker 1 SIGKILLs itself after step 12, torchrun restarts all four,
                   they load the checkpoint; from the kill to their first step after it.

Failed cells (the models of tests/survivor_cells.py: DDP, FSDP2 and tensor parallel, built once):

  typo             ``print(undefined_name)`` on every rank: until the error, and until the next
                   cell has trained one step of each model (the groups are not touched);
  one rank raises  rank 1 raises while the others wait in an all-reduce: until the error (the
                   groups rebuilt in place), and until the next cell has trained a step;
  deadlock         rank 0 all-reduces alone after the others finished the cell: until the error;
  soak             ``--soak`` mixed failing cells, each followed by a step of every model; at the
                   end, whether they equal an uninterrupted run bitwise, and the ranks' growth in
                   open descriptors and memory over the soak.

Medians over the repeats; ratios from this one run. Writes bench/results/recovery.json.
Targets: death to error at most 2 s with a collective in flight; heal to resumed at most
1.5x one rank's start and well under torchrun's restart; a deadlock named within 2 s;
the soak bitwise equal, with flat descriptors and memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit import Lab, RankFailure
from results_file import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.survivor_cells
from tests.survivor_cells import BUILD, COMPARE, FAILURES, TIMEOUTS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "recovery.json"

TORCHRUN_SCRIPT = r'''
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
path, marks, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
first = 0
if os.path.exists(path):  # resume: the state every rank loads after a restart
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"]); first = state["step"]
restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
for step in range(first, last):
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(step * world + rank))
    optimizer.zero_grad(); ddp(x).pow(2).mean().backward(); optimizer.step()
    if step == first and rank == 0 and restarted:
        with open(marks, "a") as f: f.write(f"resumed {time.time()}\n")
    if (step + 1) % 10 == 0 and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if rank == 2:
        time.sleep(0.03)  # as the lab's rank 2
    if step == 12 and rank == 1 and not restarted:
        with open(marks, "a") as f: f.write(f"killed {time.time()}\n")
        os.kill(os.getpid(), 9)
dist.destroy_process_group()
'''


def wait_for(predicate, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark waited too long")
        time.sleep(0.01)


def lab_round(lab: Lab, scratch: str, index: int) -> dict:
    directory = os.path.join(scratch, f"lab-{index}")
    lab.slow(2, 0.03)
    run = lab.train("ddp", "mlp", steps=200, log_every=1000, checkpoint_every=10, checkpoint_dir=directory,
                    background=True)
    wait_for(lambda: os.path.exists(os.path.join(directory, "step-00000010", "labkit.json")))
    time.sleep(0.25)
    finished = run.table.latest_step + 1
    killed = time.monotonic()
    lab.kill(1)
    try:
        run.wait(120)
    except RankFailure:  # the failure is what is measured
        death_to_error = time.monotonic() - killed
    else:
        raise AssertionError("the run did not fail")
    checkpoint = max(int(name.split("-")[1]) for name in os.listdir(directory) if name.startswith("step-"))
    began = time.monotonic()
    continued = lab.heal()
    wait_for(lambda: continued.table.latest_step is not None)
    heal_to_resumed = time.monotonic() - began
    continued.stop()
    continued.wait(120)
    lab.slow(2, None)
    return {"death_to_error": death_to_error, "heal_to_resumed": heal_to_resumed,
            "steps_lost": max(0, finished - checkpoint)}


def one_rank_start(lab: Lab) -> float:
    began = time.monotonic()
    lab.cluster.replace([3])
    seconds = time.monotonic() - began
    lab.session.form_group()
    return seconds


def torchrun_round(scratch: str, index: int) -> float:
    """torchrun --max-restarts 1: worker 1 SIGKILLs itself after step 12, torchrun restarts all four,
    they load the checkpoint of step 10; from the kill to their first step."""
    script = Path(scratch, "ddp_restart.py")
    script.write_text(TORCHRUN_SCRIPT)
    checkpoint, marks = Path(scratch, f"ckpt-{index}.pt"), Path(scratch, f"marks-{index}")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    # Without this, torchrun's restarted workers never finish init_process_group here: its
    # rendezvous store, shared with the workers by default, is not fit for restarts (pytorch#135712).
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run([torchrun, "--standalone", "--nproc_per_node=4", "--max-restarts=1", str(script), str(checkpoint),
                    str(marks), "20"], check=True, capture_output=True, timeout=300, env=environment)
    times = dict(line.split() for line in marks.read_text().splitlines())
    return float(times["resumed"]) - float(times["killed"])


def _failing(lab: Lab, code: str, limit=None) -> float:
    """Seconds until the failing cell raised."""
    began = time.monotonic()
    try:
        lab.run_cell(code, timeout=limit)
    except RankFailure:
        return time.monotonic() - began
    raise AssertionError(f"the cell did not fail: {code!r}")


def _next_step(lab: Lab) -> float:
    began = time.monotonic()
    lab.run_cell("train(models, optimizers, group, STEPS); STEPS += 1")
    return time.monotonic() - began


def cell_round(lab: Lab) -> dict:
    typo = _failing(lab, FAILURES[0][1])
    typo_next = _next_step(lab)
    raised = _failing(lab, FAILURES[1][1])
    raised_next = _next_step(lab)
    deadlock = _failing(lab, "if rank == 0:\n    dist.all_reduce(torch.ones(1))")
    _next_step(lab)
    return {"typo_to_error": typo, "typo_to_next_step": typo + typo_next, "raised_to_error": raised,
            "raised_to_next_step": raised + raised_next, "deadlock_to_error": deadlock}


def rank_usage() -> tuple[int, int]:
    """This rank's open file descriptors and resident memory (rank side)."""
    import gc

    import psutil

    gc.collect()
    me = psutil.Process()
    return me.num_fds(), me.memory_info().rss


def soak(lab: Lab, failures: int) -> dict:
    kinds = [(code, None) for _, code, _ in FAILURES] + [(code, limit) for _, code, _, limit in TIMEOUTS]
    began = time.monotonic()
    for index in range(failures + len(kinds)):  # the first of each kind warms what torch makes once
        if index == len(kinds):
            before, began = lab.run(rank_usage), time.monotonic()
        code, limit = kinds[index % len(kinds)]
        _failing(lab, code, limit)
        _next_step(lab)
    seconds = time.monotonic() - began
    after = lab.run(rank_usage)
    lab.run_cell(COMPARE)
    same = lab.run(lambda: __import__("IPython").get_ipython().user_ns["same"])
    return {"failures": failures, "seconds": seconds, "bitwise_equal": all(same),
            "descriptors_grown": max(a[0] - b[0] for a, b in zip(after, before)),
            "memory_grown_mb": max(a[1] - b[1] for a, b in zip(after, before)) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--soak", type=int, default=50, help="mixed failing cells in the soak (0: none)")
    options = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="labkit-bench-recovery-")
    rounds, starts, torchrun, cells = [], [], [], []
    soaked = None
    try:
        with Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=60) as lab:
            lab.run_cell(BUILD)
            lab.run_cell("models, optimizers, group = build()\nSTEPS = 0")
            for index in range(options.repeats):
                cells.append(cell_round(lab))
                print(f"cells {index + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in cells[-1].items()), flush=True)
            if options.soak:
                soaked = soak(lab, options.soak)
                print(f"soak: {soaked}", flush=True)
            lab.train("ddp", "mlp", steps=2, log_every=1000)  # warm
            for index in range(options.repeats):
                rounds.append(lab_round(lab, scratch, index))
                starts.append(one_rank_start(lab))
                torchrun.append(torchrun_round(scratch, index))
                print(f"repeat {index + 1}: {rounds[-1]}, one rank start {starts[-1]:.2f} s, "
                      f"torchrun restart {torchrun[-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    cell_median = {key: statistics.median(r[key] for r in cells) for key in cells[0]}
    start, restart = statistics.median(starts), statistics.median(torchrun)
    ratios = {
        "death to error, s (target <= 2)": median["death_to_error"],
        "heal to resumed / one rank start (target <= 1.5)": median["heal_to_resumed"] / start,
        "heal to resumed / torchrun restart": median["heal_to_resumed"] / restart,
        "deadlock to error, s (target <= 2)": cell_median["deadlock_to_error"],
        "one rank raises: to the next step / typo: to the next step": (cell_median["raised_to_next_step"]
                                                                       / cell_median["typo_to_next_step"]),
    }
    print(f"\nmedians of {options.repeats} runs on 4 ranks, seconds (machine: {os.cpu_count()} cores)")
    print(f"death to error {median['death_to_error']:.2f}  heal to resumed {median['heal_to_resumed']:.2f}  "
          f"steps lost {median['steps_lost']:.0f}  one rank start {start:.2f}  torchrun restart {restart:.2f}")
    print("failed cells: " + "  ".join(f"{key} {value:.2f}" for key, value in cell_median.items()))
    if soaked:
        print(f"soak of {soaked['failures']} failing cells in {soaked['seconds']:.0f} s: bitwise equal "
              f"{soaked['bitwise_equal']}, descriptors grown {soaked['descriptors_grown']}, memory grown "
              f"{soaked['memory_grown_mb']:.1f} MB")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    write_results(RESULTS, {"rounds": rounds, "one_rank_start_seconds": starts, "torchrun_restart_seconds": torchrun,
                            "cells": cells, "cell_medians": cell_median, "soak": soaked,
                            "medians": median, "ratios": ratios})


if __name__ == "__main__":
    main()
