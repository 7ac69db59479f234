"""Startup benchmark: a lab ready to all-reduce, against torchrun doing one all-reduce.

    ./lab bench startup [--repeats 3] [--ranks 2 4 8]

For every N, interleaved so that machine noise hits both sides alike, it measures:
  lab start   Lab(ranks=N).start() until a first all-reduce has completed, in this
              process (as in a notebook where labkit is already imported);
  lab cold    the same from a fresh interpreter (python -c "from labkit import Lab; ..."),
              which is what torchrun's number includes too;
  torchrun    `torchrun --standalone --nproc_per_node N` of a script that does one all-reduce;
and the parts of the lab's start (``Session.start_phases``): the controller up, torch imported
in the process host, engines registered, ranks assigned, the process group formed, the first
all-reduce; then the first cell. A part that grows is what joined the critical path.
Then, on a running 4-rank lab, the warm latency of a new cell that all-reduces; and, in a
fresh interpreter, the notebook side alone: ``%load_ext labkit`` plus ``Lab(ranks=4)``
(no ranks started), with the heavy libraries that loaded (none, by design).
Medians over the repeats; ratios are taken within this one run. Writes
bench/results/startup.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit import Lab
from results_file import write_results

RESULTS = Path(__file__).resolve().parent / "results" / "startup.json"

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

COLD_SCRIPT = """
import sys
from labkit import Lab
lab = Lab(ranks=int(sys.argv[1]), backend="gloo", threads_per_rank=1).start()
assert lab.run_cell("t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()", live=False) == [repr(float(lab.world_size))] * lab.world_size
lab.stop()
"""

ALL_REDUCE_CELL = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def time_lab_start(ranks: int) -> tuple[float, dict[str, float]]:
    """Seconds from ``Lab(...).start()`` to a first cell's all-reduce done, and the time of each part."""
    began = time.perf_counter()
    lab = Lab(ranks=ranks, backend="gloo", threads_per_rank=1).start()
    try:
        started = time.perf_counter()
        # start() already ran one all-reduce to check the group; a user's first cell is what counts.
        shown = lab.run_cell(ALL_REDUCE_CELL, live=False)
        elapsed = time.perf_counter() - began
        assert shown == [repr(float(ranks))] * ranks, shown
        parts, previous = {}, 0.0
        for what, at in lab.session.start_phases:
            parts[what], previous = at - previous, at
        parts["first cell"] = elapsed - (started - began)
    finally:
        lab.stop()
    return elapsed, parts


NOTEBOOK_SIDE_SCRIPT = """
import sys, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
began = time.perf_counter()
shell.run_line_magic("load_ext", "labkit")
from labkit import Lab
Lab(ranks=4)
took = time.perf_counter() - began
print(took, ",".join(m for m in ("torch", "matplotlib", "ipywidgets") if m in sys.modules))
"""


def time_notebook_side() -> tuple[float, str]:
    """Seconds for ``%load_ext labkit`` + ``Lab(ranks=4)`` in a fresh interpreter, and what heavy modules loaded."""
    done = subprocess.run([sys.executable, "-c", NOTEBOOK_SIDE_SCRIPT], capture_output=True, text=True, check=True)
    seconds, _, loaded = done.stdout.strip().partition(" ")
    return float(seconds), loaded


def time_command(command: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


def time_warm_cells(ranks: int, cells: int) -> list[float]:
    with Lab(ranks=ranks, backend="gloo", threads_per_rank=1) as lab:
        lab.run_cell(ALL_REDUCE_CELL, live=False)  # first call warms imports on the ranks
        times = []
        for _ in range(cells):
            began = time.perf_counter()
            lab.run_cell(ALL_REDUCE_CELL, live=False)
            times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--warm-cells", type=int, default=30)
    options = parser.parse_args()

    torchrun = [str(Path(sys.executable).with_name("torchrun"))]
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch, "one_all_reduce.py")
        script.write_text(TORCHRUN_SCRIPT)
        samples: dict[str, dict[int, list[float]]] = {"lab start": {}, "lab cold": {}, "torchrun": {}}
        parts: dict[int, dict[str, list[float]]] = {}
        for repeat in range(options.repeats):
            for ranks in options.ranks:
                samples["torchrun"].setdefault(ranks, []).append(
                    time_command([*torchrun, "--standalone", f"--nproc_per_node={ranks}", str(script)])
                )
                seconds, lab_parts = time_lab_start(ranks)
                samples["lab start"].setdefault(ranks, []).append(seconds)
                for what, took in lab_parts.items():
                    parts.setdefault(ranks, {}).setdefault(what, []).append(took)
                samples["lab cold"].setdefault(ranks, []).append(
                    time_command([sys.executable, "-c", COLD_SCRIPT, str(ranks)])
                )
                print(f"repeat {repeat + 1}/{options.repeats}, N={ranks}: "
                      + ", ".join(f"{k} {v[ranks][-1]:.2f} s" for k, v in samples.items()), flush=True)
    warm = time_warm_cells(4, options.warm_cells)
    notebook_side = [time_notebook_side() for _ in range(max(3, options.repeats))]
    notebook_seconds = statistics.median(seconds for seconds, _ in notebook_side)
    heavy_loaded = sorted({name for _, loaded in notebook_side for name in loaded.split(",") if name})

    median = {kind: {n: statistics.median(v) for n, v in by_n.items()} for kind, by_n in samples.items()}
    warm_median = statistics.median(warm)
    n_mid = 4 if 4 in options.ranks else options.ranks[len(options.ranks) // 2]
    ratios = {
        f"lab start / torchrun at N={n_mid} (target <= 0.5)": median["lab start"][n_mid] / median["torchrun"][n_mid],
        f"lab cold / torchrun at N={n_mid}": median["lab cold"][n_mid] / median["torchrun"][n_mid],
        f"torchrun N={n_mid} / warm cell (target >= 20)": median["torchrun"][n_mid] / warm_median,
    }
    if min(options.ranks) != max(options.ranks):
        lo, hi = min(options.ranks), max(options.ranks)
        ratios[f"lab start t({hi}) / t({lo}) (target <= 2)"] = median["lab start"][hi] / median["lab start"][lo]

    print(f"\nmedians of {options.repeats} runs, seconds (machine: {os.cpu_count()} cores)")
    print(f"{'N':>3}  {'lab start':>10}  {'lab cold':>9}  {'torchrun':>9}")
    for n in options.ranks:
        print(f"{n:>3}  {median['lab start'][n]:>10.2f}  {median['lab cold'][n]:>9.2f}  {median['torchrun'][n]:>9.2f}")
    part_medians = {n: {what: statistics.median(v) for what, v in by_part.items()} for n, by_part in parts.items()}
    print(f"\nparts of the lab's start at N={n_mid}, medians, seconds:")
    for what, took in part_medians[n_mid].items():
        print(f"  {what:<32} {took:6.2f}")
    print(f"warm cell with one all-reduce, 4 ranks: median {warm_median * 1000:.1f} ms "
          f"(p90 {sorted(warm)[int(0.9 * len(warm)) - 1] * 1000:.1f} ms, {len(warm)} cells)")
    print(f"notebook side (%load_ext labkit + Lab(ranks=4), fresh interpreter): median {notebook_seconds:.3f} s; "
          f"heavy libraries loaded: {', '.join(heavy_loaded) or 'none'}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")

    write_results(RESULTS, {
        "repeats": options.repeats,
        "samples": {kind: {str(n): v for n, v in by_n.items()} for kind, by_n in samples.items()},
        "median_seconds": {kind: {str(n): v for n, v in by_n.items()} for kind, by_n in median.items()},
        "start_parts_median_seconds": {str(n): by_part for n, by_part in part_medians.items()},
        "warm_cell_seconds": warm,
        "notebook_side_seconds": [seconds for seconds, _ in notebook_side],
        "notebook_side_heavy_modules": heavy_loaded,
        "ratios": ratios,
    })


if __name__ == "__main__":
    main()
