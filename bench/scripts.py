"""Script benchmark: time to result for the same torchrun-style script, torchrun against %lab run.

    ./lab bench scripts [--repeats 5]

The script is the workshop's DDP trainer (``notebooks/scripts/ddp_trainer.py``:
argparse, a Trainer class, its own init/destroy_process_group; its own work
takes well under a second). On 4 gloo ranks with one thread each, interleaved
so that machine noise hits both sides alike:

  torchrun    `python -m torch.distributed.run --standalone --nproc_per_node 4` of the
              script, from launch to exit: every run is a cold start;
  lab first   `Lab(ranks=4).start()` and then `lab.run_script(...)`, in this process
              (a notebook where labkit is already imported);
  lab warm    `lab.run_script(...)` again on the running lab.

Both sides must print the same result line. Target: a warm run at least 5x faster
than torchrun. Medians over the repeats; ratios from this one run. Writes
bench/results/scripts.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from labkit import Lab

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "notebooks" / "scripts" / "ddp_trainer.py"
ARGS = ("--epochs", "3")
RESULTS = Path(__file__).resolve().parent / "results" / "scripts.json"
RESULT = re.compile(r"world 4 loss \S+ checksum \S+")


def time_torchrun() -> tuple[float, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(SCRIPT), *ARGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    began = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    elapsed = time.perf_counter() - began
    if finished.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{finished.stderr[-2000:]}")
    return elapsed, RESULT.search(finished.stdout).group(0)


def run_in_lab(lab: Lab) -> str:
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        lab.run_script(SCRIPT, *ARGS)
    return RESULT.search(said.getvalue()).group(0)


def time_lab(warm_runs: int) -> tuple[float, list[float], str]:
    began = time.perf_counter()
    lab = Lab(ranks=4, backend="gloo", threads_per_rank=1).start()
    try:
        result = run_in_lab(lab)
        first = time.perf_counter() - began
        warm = []
        for _ in range(warm_runs):
            began = time.perf_counter()
            if run_in_lab(lab) != result:
                raise RuntimeError("a warm run printed another result than the first")
            warm.append(time.perf_counter() - began)
        return first, warm, result
    finally:
        lab.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    torchrun, first, warm, results = [], [], [], set()
    for repeat in range(options.repeats):
        seconds, result = time_torchrun()
        torchrun.append(seconds)
        results.add(result)
        lab_first, lab_warm, result = time_lab(warm_runs=3)
        first.append(lab_first)
        warm.extend(lab_warm)
        results.add(result)
        print(f"repeat {repeat + 1}/{options.repeats}: torchrun {seconds:.2f} s, lab first {lab_first:.2f} s, "
              f"lab warm {statistics.median(lab_warm) * 1000:.0f} ms", flush=True)
    if len(results) != 1:
        raise SystemExit(f"torchrun and the lab printed different results: {sorted(results)}")
    summary = {"torchrun": statistics.median(torchrun), "lab first": statistics.median(first),
               "lab warm": statistics.median(warm)}
    speedup = summary["torchrun"] / summary["lab warm"]
    print(f"\n{'':12}{'median':>10}")
    for name, seconds in summary.items():
        print(f"{name:12}{seconds:>9.3f}s")
    print(f"the same result both ways: {results.pop()}")
    print(f"warm %lab run is {speedup:.1f}x faster than torchrun (target at least 5x); "
          f"first run including start: {summary['torchrun'] / summary['lab first']:.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(), "python": platform.python_version(),
        "script": str(SCRIPT.relative_to(ROOT)), "args": ARGS, "median_seconds": summary,
        "warm_speedup": speedup, "samples_seconds": {"torchrun": torchrun, "lab first": first, "lab warm": warm},
    }, indent=2))
    print(f"wrote {RESULTS.name}")


if __name__ == "__main__":
    main()
