"""GPU check: the nccl path trains, and what it costs, measured in one run.

    python3 bench/gpu.py [--out PATH] [--repeats 3] [--parts performance,correctness,...]
    ./lab gpu-check                    (the same, with the machine's own CUDA torch: see ./lab)
    ./lab bench gpu                    (the same, in the project's .venv: the torch ./lab installed)
    python bench/gpu.py --cpu-dry-run  (every part on gloo/CPU with tiny sizes: tests the logic)

Made to run once on a machine lent with GPUs, in about six minutes on one H200; it
needs only torch (2.6+) with CUDA, labkit's checkout on the path, and ipyparallel's
stack (wheels on PYTHONPATH will do: ``shared/tools/gpu-wheels`` prepares them, then
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site:$PWD python3 bench/gpu.py``). It refuses, with exit code 2,
when no CUDA GPU is visible. Parts:

1. environment: GPU name(s) and count, torch, CUDA and NCCL versions;
2. performance, on the GPT of vocab 256, dim 512, 8 heads, 8 layers, sequence 256
   (~25M parameters), AdamW, fp32, global batch 32 and then 128, on one GPU:
   (a) a plain PyTorch loop in this process (the same model and data, AdamW's
   default settings, losses read every 10 steps), (b) the lab's loop
   (``labkit.rank.loop.train``) under ``torchrun --standalone --nproc_per_node 1``,
   (c) ``lab.train("ddp", ...)`` on a 1-rank nccl lab without instruments and
   (d) with them. Per-step times from CUDA events, warm-up steps left out, medians
   over ``--repeats`` runs of each, the order alternating (no new round once one
   more would pass ``--performance-budget`` seconds). Targets, as ratios from the
   same run: lab/torchrun <= 1.03, lab/plain <= 1.05, instruments on/off <= 1.03;
3. correctness: every strategy and composition that fits the visible GPUs (1 GPU:
   ddp, fsdp; 2: also tp, pp; 4 or more: all nine, on 4 ranks) trained with
   ``verify=True`` and instruments on the zoo's default GPT: equivalent to
   single-process training, and every step row's compute + exposed communication
   equal to its time within 1%;
4. mixed precision: the big GPT under ddp and fsdp in fp32, fp32 with TF32 and
   bf16, instruments off: tokens/s, achieved TFLOP/s and MFU against the device's
   peak; then, apart, bf16 (each strategy) once more with instruments on, against
   off (one run each; the target 1.03 reported, not failing);
5. the wire: ``lab.bench_collective("all_reduce")`` on the GPU ranks, bus bandwidth
   per size against the device-to-device copy bandwidth;
6. instruments' accuracy: loops of blocking all-reduces on an instrumented group,
   the communication time the rows report against the same calls timed with CUDA
   events, and the bytes counted (degenerate with one rank, still run).

Prints a table per part and a PASS/FAIL line per check; writes everything to
bench/results/gpu.json (with the date and the GPU's name). Exit code 1 when a
correctness check failed or a part could not run; performance targets missed are
reported, not a failing exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu.json"
if str(ROOT) not in sys.path:  # a bare checkout with nothing installed (the GPU machine)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from labkit import Lab  # noqa: E402
from labkit.strategies.catalog import compositions  # noqa: E402

PARTS = ("performance", "correctness", "mixed_precision", "collective", "instrument_accuracy")
MESH_ON_4 = {"fsdp+tp": dict(dp=2, tp=2), "ddp+tp": dict(dp=2, tp=2), "ddp+pp": dict(dp=2, pp=2),
             "fsdp+pp": dict(dp=2, pp=2), "pp+tp": dict(pp=2, tp=2)}
TARGETS = {"lab/torchrun": 1.03, "lab/plain": 1.05, "instruments on/off": 1.03}
ACCURACY_TOLERANCE = 0.15  # reported against direct communication time, as bench/instruments.py
ROWS_TOLERANCE = 0.01  # compute + exposed_comm against seconds
LOG_EVERY = 10  # the lab and torchrun read the loss every 10 steps, as the plain loop does
MARKER = "GPU-BENCH-RESULT "

TORCHRUN_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

runs, backend = json.loads(sys.argv[1]), sys.argv[2]
if backend == "nccl":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl")  # as the lab's ranks: small CPU tensors beside nccl
else:
    dist.init_process_group("gloo")
from labkit.rank.loop import ScriptContext, train
from labkit.spec.train_config import resolve

context = ScriptContext()
times = [train(resolve(dist.get_world_size(), **settings), context)["step_seconds"] for settings in runs]
if dist.get_rank() == 0:
    print("%s" + json.dumps(times), flush=True)
dist.destroy_process_group()
""" % MARKER


@dataclass(frozen=True)
class Plan:
    """Every size of the run: the GPU plan, or the tiny one of a CPU dry run."""

    dry_run: bool
    backend: str
    device: str
    check_ranks: int  # ranks of the lab for parts 3-6
    big: dict = field(default_factory=lambda: dict(vocab=256, dim=512, heads=8, layers=8, seq=256))
    small: dict = field(default_factory=dict)  # the zoo's default GPT
    batches: tuple[int, ...] = (32, 128)
    warmup: int = 5
    timed: dict = field(default_factory=lambda: {32: 40, 128: 30})
    repeats: int = 3
    check_batch: int = 32
    check_steps: int = 10
    mixed_batch: int = 128
    mixed_steps: int = 20
    collective_sizes: tuple[int, ...] = tuple(2**power for power in range(10, 29, 2))  # 1 KiB .. 256 MiB
    collective_iterations: int | None = None
    accuracy_sizes: tuple[int, ...] = (4 * 2**10, 256 * 2**10, 4 * 2**20, 64 * 2**20)
    accuracy_count: int = 40
    performance_budget: float = 200.0  # seconds for part 2: no new round once another would pass it
    lab_timeout: float = 180.0  # each lab call; a hung collective must not eat the machine's lease
    start_timeout: float = 120.0
    torchrun_timeout: float = 180.0

    def steps(self, batch: int) -> int:
        return self.warmup + self.timed[batch]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def gpu_plan(gpus: int, repeats: int, performance_budget: float) -> Plan:
    check_ranks = 4 if gpus >= 4 else 2 if gpus >= 2 else 1
    return Plan(dry_run=False, backend="nccl", device="cuda", check_ranks=check_ranks, repeats=repeats,
                performance_budget=performance_budget)


def dry_plan(repeats: int, performance_budget: float) -> Plan:
    return Plan(
        dry_run=True, backend="gloo", device="cpu", check_ranks=2, repeats=min(repeats, 2),
        performance_budget=performance_budget,
        big=dict(vocab=32, dim=32, heads=4, layers=2, seq=16), small=dict(vocab=32, dim=32, heads=4, layers=2, seq=16),
        batches=(8, 16), warmup=2, timed={8: 4, 16: 4}, check_batch=8, check_steps=4, mixed_batch=8, mixed_steps=4,
        collective_sizes=(2**10, 2**16), collective_iterations=5, accuracy_sizes=(4 * 2**10, 256 * 2**10),
        accuracy_count=10, lab_timeout=300.0, start_timeout=120.0, torchrun_timeout=300.0,
    )


@dataclass
class Check:
    """One verdict. kind 'correctness' fails the run; 'target' is reported. passed None: not applicable."""

    name: str
    kind: str
    passed: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        return "N/A " if self.passed is None else "PASS" if self.passed else "FAIL"


# -- small helpers ----------------------------------------------------------------


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


def number(value: float | None, format_: str = ",.0f") -> str:
    return "unknown" if value is None else format(value, format_)


def steady_median(step_seconds: list[float], warmup: int) -> float:
    return statistics.median(step_seconds[warmup:] or step_seconds)


def use_this_checkout() -> dict:
    """The environment for every process started here: this checkout importable, loopback sockets."""
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(part for part in (str(ROOT), path) if part)
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


class StepClock:
    """Per-step times as the lab's ``StepTimer`` takes them: from one step's start to the next.

    CUDA events on the current stream on a GPU (perf_counter on a CPU), one where
    each step starts and one after the last: a step's time is the period to the
    next start, so GPU time left idle between steps (waiting for data) counts,
    as it does for the lab.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if not self.cuda:
            self.marks.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append(event)

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [later - earlier for earlier, later in zip(self.marks, self.marks[1:])]
        torch.cuda.synchronize()
        return [earlier.elapsed_time(later) / 1000 for earlier, later in zip(self.marks, self.marks[1:])]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- part 1: environment ----------------------------------------------------------


def environment() -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "gpu_count": gpus,
        "gpus": [torch.cuda.get_device_name(index) for index in range(gpus)],
        "cores": os.cpu_count(),
        "tf32_matmul_default": torch.backends.cuda.matmul.allow_tf32,
    }
    if gpus:
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:  # a build without NCCL says so here
            info["nccl"] = f"unavailable ({error})"
    return info


def print_environment(info: dict) -> None:
    names = ", ".join(f"{index}: {name}" for index, name in enumerate(info["gpus"])) or "none"
    print(f"GPUs ({info['gpu_count']}): {names}")
    print(f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, Python {info['python']}, "
          f"{info['cores']} cores", flush=True)


# -- part 2: performance ------------------------------------------------------------


def plain_loop(plan: Plan, batch: int) -> dict:
    """(a) The loop a careful user writes: same model and data, AdamW's defaults, losses read every 10 steps."""
    from labkit.zoo.configs import model_config
    from labkit.zoo.data import dataset_for
    from labkit.zoo.models import build_model

    device = torch.device(plan.device)
    config = model_config("gpt", **plan.big)
    model = build_model("gpt", config, 0, device)
    data = dataset_for("gpt", config, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clock, pending, losses = StepClock(device), [], []
    steps = plan.steps(batch)
    wall_began = time.perf_counter()
    for step in range(steps):
        if step == plan.warmup:
            synchronize(device)
            wall_began = time.perf_counter()
        clock.mark()
        inputs, targets = (tensor.to(device) for tensor in data.batch(step, batch))
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        pending.append(loss.detach())
        if step % LOG_EVERY == 0 or step == steps - 1:
            losses.extend(torch.stack(pending).tolist())
            pending.clear()
    clock.mark()
    synchronize(device)
    wall = time.perf_counter() - wall_began
    seconds = clock.seconds()
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the device's memory to the ranks
    return {"median_step_seconds": steady_median(seconds, plan.warmup),
            "wall_seconds_per_step": wall / max(1, steps - plan.warmup), "final_loss": losses[-1]}


def torchrun_settings(plan: Plan, batch: int, steps: int | None = None) -> dict:
    return dict(strategy="ddp", model="gpt", steps=steps or plan.steps(batch), global_batch=batch,
                model_settings=plan.big, instruments=False, log_every=LOG_EVERY)


def torchrun_runs(plan: Plan, script: Path, env: dict) -> dict[int, float]:
    """(b) One torchrun process: a warm-up run, then every batch size; median step time per batch."""
    runs = [torchrun_settings(plan, plan.batches[0], steps=plan.warmup)]
    runs += [torchrun_settings(plan, batch) for batch in plan.batches]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(script), json.dumps(runs), plan.backend]
    for attempt in range(2):  # --standalone picks a free port; a rare clash fails the launch
        finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=plan.torchrun_timeout)
        lines = [line for line in finished.stdout.splitlines() if line.startswith(MARKER)]
        if finished.returncode == 0 and lines:
            times = json.loads(lines[-1][len(MARKER):])[1:]
            return {batch: steady_median(seconds, plan.warmup) for batch, seconds in zip(plan.batches, times)}
        tail = (finished.stderr or finished.stdout).strip().splitlines()[-15:]
        print(f"torchrun failed (attempt {attempt + 1}, exit {finished.returncode}):\n  " + "\n  ".join(tail), flush=True)
    raise RuntimeError("the lab's loop under torchrun failed twice (see its output above)")


def lab_run(lab: Lab, plan: Plan, batch: int, instruments: bool) -> float:
    """(c), (d) ``lab.train`` on the 1-rank lab: median of the steady steps (slowest rank)."""
    report = lab.train("ddp", "gpt", steps=plan.steps(batch), global_batch=batch, model_settings=plan.big,
                       instruments=instruments, verify=False, log_every=LOG_EVERY)
    return steady_median(report.step_seconds, plan.warmup)


def performance_round(lab: Lab, plan: Plan, script: Path, env: dict, order: list[str]) -> dict[str, dict]:
    """One run of every variant at every batch size, in ``order``: median step seconds (and the plain wall)."""
    measured = {}
    for variant in order:
        if variant == "plain":
            plain = {batch: plain_loop(plan, batch) for batch in plan.batches}
            measured[variant] = {batch: run["median_step_seconds"] for batch, run in plain.items()}
            measured["plain wall"] = {batch: run["wall_seconds_per_step"] for batch, run in plain.items()}
        elif variant == "torchrun":
            measured[variant] = torchrun_runs(plan, script, env)
        else:
            measured[variant] = {batch: lab_run(lab, plan, batch, instruments=variant == "lab, instruments")
                                 for batch in plan.batches}
    return measured


def performance(lab: Lab, plan: Plan, checks: list[Check], env: dict) -> dict:
    variants = ["plain", "torchrun", "lab", "lab, instruments"]
    samples = {variant: {batch: [] for batch in plan.batches} for variant in [*variants, "plain wall"]}
    began = time.monotonic()
    # Warm-up, untimed: kernels chosen, allocator grown, in this process and in the rank.
    plain_loop(plan, plan.batches[0])
    lab.train("ddp", "gpt", steps=plan.warmup, global_batch=plan.batches[0], model_settings=plan.big,
              instruments=False, log_every=10**9)
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch, "lab_loop_under_torchrun.py")
        script.write_text(TORCHRUN_SCRIPT)
        rounds, longest = 0, 0.0
        for repeat in range(plan.repeats):
            if rounds and time.monotonic() - began + longest > plan.performance_budget:
                print(f"performance: stopping after {rounds} round(s); another would pass the part's budget of "
                      f"{plan.performance_budget:.0f} s (--performance-budget)", flush=True)
                break
            round_began = time.monotonic()
            order = variants if repeat % 2 == 0 else variants[::-1]
            measured = performance_round(lab, plan, script, env, order)
            rounds, longest = rounds + 1, max(longest, time.monotonic() - round_began)
            for variant, by_batch in measured.items():
                for batch, seconds in by_batch.items():
                    samples[variant][batch].append(seconds)
            summary = "; ".join(f"{variant} " + "/".join(ms(measured[variant][b]) for b in plan.batches)
                                for variant in variants)
            print(f"performance round {repeat + 1}/{plan.repeats} (batch {'/'.join(map(str, plan.batches))}): "
                  f"{summary}", flush=True)
    rows, result = [], {"batches": {}, "rounds": rounds, "seconds": time.monotonic() - began,
                        "plain_optimizer": "torch.optim.AdamW(lr=1e-3), every other setting its default"}
    for batch in plan.batches:
        medians = {variant: statistics.median(samples[variant][batch]) for variant in variants}
        wall = statistics.median(samples["plain wall"][batch])
        ratios = {
            "lab/torchrun": medians["lab"] / medians["torchrun"],
            "lab/plain": medians["lab"] / medians["plain"],
            "instruments on/off": medians["lab, instruments"] / medians["lab"],
        }
        tokens = batch * plan.big["seq"]
        result["batches"][str(batch)] = {
            "median_step_seconds": medians, "samples_seconds": {v: samples[v][batch] for v in variants},
            "ratios": ratios, "plain_wall_seconds_per_step": wall,
            "tokens_per_second": {variant: tokens / seconds for variant, seconds in medians.items()},
        }
        rows.append([batch, *(ms(medians[v]) for v in variants), ms(wall),
                     *(f"{ratios[name]:.3f}" for name in TARGETS)])
        for name, limit in TARGETS.items():
            checks.append(Check(f"{name} at batch {batch} <= {limit}", "target", ratios[name] <= limit,
                                f"{ratios[name]:.3f}"))
    print(table(["batch", "plain", "torchrun", "lab", "lab+instr", "plain wall", *TARGETS], rows))
    print(f"(medians of {rounds} runs; per-step times from {'CUDA events' if plan.cuda else 'perf_counter'}, "
          f"first {plan.warmup} steps left out; 'plain wall': its wall time per step, data generation included; "
          f"plain uses AdamW's defaults, the lab labkit.torch_support.optimizers.make_optimizer)")
    return result


# -- part 3: correctness ------------------------------------------------------------


def strategies_for(ranks: int) -> tuple[str, ...]:
    return compositions(ranks) if ranks >= 2 else ("ddp", "fsdp")


def row_problems(report, communicates: bool) -> list[str]:
    """What is wrong with the step rows: sums, signs, missing communication where ranks talk."""
    problems = []
    for result in report.results:
        rank, rows = result["rank"], result.get("rows") or []
        if not rows:
            problems.append(f"rank {rank}: no rows")
            continue
        for row in rows:
            where = f"rank {rank} step {row.get('step')}"
            total = row["compute"] + row["exposed_comm"]
            if abs(total - row["seconds"]) > ROWS_TOLERANCE * row["seconds"] + 1e-7:
                problems.append(f"{where}: compute {row['compute']:.6f} + exposed {row['exposed_comm']:.6f} "
                                f"!= seconds {row['seconds']:.6f}")
            if not (row["seconds"] > 0 and row["compute"] > 0 and row["exposed_comm"] >= 0):
                problems.append(f"{where}: seconds {row['seconds']:.6f}, compute {row['compute']:.6f}, "
                                f"exposed {row['exposed_comm']:.6f} (positive expected)")
        if communicates:
            if not sum(row["exposed_comm"] for row in rows) > 0:
                problems.append(f"rank {rank}: no exposed communication in any step")
            if not sum(sum(row["comm"].values()) for row in rows) > 0:
                problems.append(f"rank {rank}: no communication time in any step")
            if not sum(sum(row["bytes"].values()) for row in rows) > 0:
                problems.append(f"rank {rank}: no bytes communicated in any step")
    return problems


def own_settings(strategy: str, world_size: int, batch: int) -> dict:
    """What a strategy needs for a short check: DiLoCo's outer step within the check's few steps,
    a batch the parameter server's workers (all ranks but its one server) divide."""
    parts = strategy.split("+")
    if "diloco" in parts:
        return {"inner_steps": 2, "global_batch": batch}
    if "ps" in parts:
        workers = world_size - 1
        return {"global_batch": max(workers, batch // workers * workers)}
    return {"global_batch": batch}


def correctness(lab: Lab, plan: Plan, checks: list[Check]) -> dict:
    runs, rows = [], []
    for strategy in strategies_for(lab.world_size):
        mesh = MESH_ON_4.get(strategy) if lab.world_size == 4 else None
        try:
            report = lab.train(strategy, "gpt", steps=plan.check_steps, mesh=mesh, model_settings=plan.small,
                               verify=True, instruments=True, log_every=10**9,
                               **own_settings(strategy, lab.world_size, plan.check_batch))
        except Exception as error:  # one strategy failing must not hide the others
            message = f"{type(error).__name__}: {error}"
            runs.append({"strategy": strategy, "error": message})
            rows.append([strategy, "-", "error", "-", "-", "-"])
            checks.append(Check(f"{strategy}: trains with verify=True", "correctness", False, message[:400]))
            continue
        problems = row_problems(report, communicates=lab.world_size > 1)
        compute, exposed = report.per_rank_means("compute"), report.per_rank_means("exposed_comm")
        runs.append({"strategy": strategy, "mesh": report.config.mesh.describe(), "equivalent": report.equivalent,
                     "max_relative_difference": report.max_relative_difference,
                     "equivalence_bound": report.equivalence_bound,
                     "rounding_noise": report.verify.get("rounding_noise"),
                     "median_step_seconds": report.median_step_seconds, "compute_mean_per_rank": compute,
                     "exposed_comm_mean_per_rank": exposed, "comm_bytes_per_step": report.comm_bytes_per_step,
                     "row_problems": problems})
        rows.append([strategy, report.config.mesh.describe(), number(report.max_relative_difference, ".1e"),
                     number(report.equivalence_bound, ".1e"), ms(report.median_step_seconds),
                     "ok" if not problems else f"{len(problems)} problems"])
        checks.append(Check(f"{strategy}: equivalent to single-process training", "correctness",
                            report.equivalent is True, f"max relative difference {report.max_relative_difference:.2e}, "
                            f"bound {report.equivalence_bound:.1e}"))
        checks.append(Check(f"{strategy}: rows add up (compute + exposed = step within 1%, signs)", "correctness",
                            not problems, "; ".join(problems[:3]) or "every row"))
        for problem in problems[:5]:
            print(f"  {strategy}: {problem}")
    print(table(["strategy", "mesh", "max rel diff", "bound", "step", "rows"], rows))
    return {"ranks": lab.world_size, "runs": runs}


# -- part 4: mixed precision -----------------------------------------------------------


# The one setting also run with instruments on, per strategy: bf16 has the shortest steps, so what
# the instruments add is the largest share of a step there (the other settings pay at most that).
# One run more per strategy, not per setting: the whole script must stay near six minutes on one GPU.
INSTRUMENTED_SETTING = ("bf16", False)


def mixed_run(lab: Lab, plan: Plan, strategy: str, precision: str, tf32: bool, instruments: bool) -> dict:
    report = lab.train(strategy, "gpt", steps=plan.mixed_steps, global_batch=plan.mixed_batch,
                       model_settings=plan.big, precision=precision, tf32=tf32, instruments=instruments,
                       log_every=10**9)
    return {"strategy": strategy, "precision": precision, "tf32": tf32, "instruments": instruments,
            "median_step_seconds": report.median_step_seconds, "tokens_per_second": report.tokens_per_second,
            "model_flops_per_step": report.model_flops_per_step, "achieved_tflops": report.achieved_tflops,
            "peak_tflops": report.peak_tflops, "mfu": report.mfu, "device_name": report.device_name}


def mixed_precision(lab: Lab, plan: Plan, checks: list[Check]) -> dict:
    """Throughput and MFU of each precision with the instruments off (what the training itself
    reaches); then, apart, the same run with them on against off."""
    settings = [("fp32", False), ("fp32", True), ("bf16", False)]
    runs, rows, tokens, instrument_cost, cost_rows = [], [], {}, [], []
    for strategy in ("ddp", "fsdp"):
        for precision, tf32 in settings:
            name = f"{strategy} {precision}{' + tf32' if tf32 else ''}"
            if tf32 and not plan.cuda:
                runs.append({"name": name, "skipped": "TF32 is a GPU setting; the lab refuses it on CPU ranks"})
                rows.append([name, "skipped (CPU)", "", "", "", ""])
                continue
            off = dict(name=name, **mixed_run(lab, plan, strategy, precision, tf32, instruments=False))
            tokens[(strategy, precision, tf32)] = off["tokens_per_second"]
            runs.append(off)
            rows.append([name, ms(off["median_step_seconds"]), number(off["tokens_per_second"]),
                         number(off["achieved_tflops"], ".1f"), number(off["peak_tflops"], ".0f"),
                         "unknown" if off["mfu"] is None else f"{off['mfu']:.1%}"])
            if off["mfu"] is not None:
                checks.append(Check(f"{name}: 0 < MFU <= 1", "correctness", 0 < off["mfu"] <= 1, f"{off['mfu']:.3f}"))
            if (precision, tf32) == INSTRUMENTED_SETTING:  # right after its run without, on the same warm GPU
                on = mixed_run(lab, plan, strategy, precision, tf32, instruments=True)
                ratio = on["median_step_seconds"] / off["median_step_seconds"]
                instrument_cost.append({"name": name, "step_seconds_off": off["median_step_seconds"],
                                        "step_seconds_on": on["median_step_seconds"],
                                        "tokens_per_second_off": off["tokens_per_second"],
                                        "tokens_per_second_on": on["tokens_per_second"], "on/off": ratio})
                cost_rows.append([name, ms(off["median_step_seconds"]), ms(on["median_step_seconds"]),
                                  number(off["tokens_per_second"]), number(on["tokens_per_second"]), f"{ratio:.3f}"])
                checks.append(Check(f"{name}: instruments on/off <= {TARGETS['instruments on/off']}", "target",
                                    ratio <= TARGETS["instruments on/off"], f"{ratio:.3f} (one run each)"))
    print("instruments off:")
    print(table(["run", "step", "tokens/s", "TFLOP/s", "peak", "MFU"], rows))
    n_params = parameter_count(plan.big)
    print(f"(global batch {plan.mixed_batch} on {lab.world_size} rank(s); for scale: 6 x {n_params / 1e6:.1f}M "
          f"parameters x {plan.mixed_batch * plan.big['seq']:,} tokens = "
          f"{6 * n_params * plan.mixed_batch * plan.big['seq'] / 1e12:.3f} TFLOP per step, attention left out)")
    print("instruments on against off (median step over one run each):")
    print(table(["run", "step off", "step on", "tokens/s off", "tokens/s on", "on/off"], cost_rows))
    if plan.cuda:
        for strategy in ("ddp", "fsdp"):
            fp32 = tokens.get((strategy, "fp32", False))
            for precision, tf32 in settings[1:]:
                faster = tokens.get((strategy, precision, tf32))
                if fp32 and faster:
                    label = "tf32" if tf32 else precision
                    checks.append(Check(f"{strategy}: {label} faster than fp32", "target", faster > fp32,
                                        f"{faster / fp32:.2f}x"))
    return {"global_batch": plan.mixed_batch, "ranks": lab.world_size, "instruments": False, "runs": runs,
            "instrument_cost": instrument_cost}


def parameter_count(settings: dict) -> int:
    from labkit.zoo.configs import model_config
    from labkit.zoo.models import build_model

    return sum(p.numel() for p in build_model("gpt", model_config("gpt", **settings), 0, "meta").parameters())


# -- part 5: collective bandwidth ------------------------------------------------------------


def collective(lab: Lab, plan: Plan, checks: list[Check]) -> dict:
    bench = lab.bench_collective("all_reduce", sizes=list(plan.collective_sizes),
                                 iterations=plan.collective_iterations)
    rows = [[_size(size), f"{seconds * 1e6:.1f} us", f"{algbw / 1e9:.2f} GB/s", f"{busbw / 1e9:.2f} GB/s",
             f"{busbw / bench.memcpy:.1%}"]
            for size, seconds, algbw, busbw in zip(bench.sizes, bench.seconds, bench.algbw, bench.busbw)]
    print(table(["size", "time", "algbw", "busbw", "busbw/copy"], rows))
    print(f"copy bandwidth on rank 0 (the ceiling): {bench.memcpy / 1e9:.1f} GB/s"
          + ("; with 1 rank nothing crosses a link, so bus bandwidth is 0 by definition" if lab.world_size == 1 else ""))
    checks.append(Check("all_reduce bench: every size timed", "correctness",
                        all(seconds > 0 for seconds in bench.seconds) and len(bench.seconds) == len(bench.sizes),
                        f"{len(bench.seconds)} sizes"))
    return {"ranks": lab.world_size, "sizes": bench.sizes, "seconds": bench.seconds, "algbw": bench.algbw,
            "busbw": bench.busbw, "memcpy": bench.memcpy}


def _size(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


# -- part 6: instruments' accuracy ---------------------------------------------------------


def timed_all_reduces(sizes, count):
    """Rank side: per size, (reported comm, direct comm, reported exposed, step wall) in seconds, bytes counted.

    Direct times come from CUDA events around each blocking call on a GPU rank
    (perf_counter on a CPU rank); the reported ones from the rank's step row.
    """
    import time as clock

    import torch
    import torch.distributed as dist

    from labkit import this_rank

    runtime = this_rank()
    device = runtime.device
    cuda = device.type == "cuda"
    group = runtime.mesh_for((dist.get_world_size(),), ("dp",)).get_group()  # instrumented
    recorder = runtime.recorder
    recorder.clear()
    direct = []
    for index, size in enumerate(sizes):
        tensor = torch.ones(size // 4, device=device)
        recorder.paused = True  # warm-up: not part of any row
        for _ in range(3):
            dist.all_reduce(tensor, group=group)
        recorder.paused = False
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        recorder.begin_step(index)
        spans = []
        for _ in range(count):
            if cuda:
                began = torch.cuda.Event(enable_timing=True)
                began.record()
            else:
                began = clock.perf_counter()
            dist.all_reduce(tensor, group=group)
            if cuda:
                ended = torch.cuda.Event(enable_timing=True)
                ended.record()
            else:
                ended = clock.perf_counter()
            spans.append((began, ended))
        recorder.end_step(0, None, None)
        if cuda:
            torch.cuda.synchronize(device)
            direct.append(sum(began.elapsed_time(ended) for began, ended in spans) / 1000)
        else:
            direct.append(sum(ended - began for began, ended in spans))
    recorder.finish()
    rows = {row["step"]: row for row in recorder.rows}
    missing = [index for index in range(len(sizes)) if index not in rows]
    if missing:
        raise RuntimeError(f"the recorder made no row for step(s) {missing}")
    return [(rows[i]["comm"].get("all_reduce", 0.0), direct[i], rows[i]["exposed_comm"], rows[i]["seconds"],
             rows[i]["bytes"].get("all_reduce", 0)) for i in range(len(sizes))]


def instrument_accuracy(lab: Lab, plan: Plan, checks: list[Check]) -> dict:
    per_rank = lab.run(timed_all_reduces, list(plan.accuracy_sizes), plan.accuracy_count)
    degenerate = lab.world_size == 1
    rows, table_rows = [], []
    for index, size in enumerate(plan.accuracy_sizes):
        reported = statistics.fmean(rank[index][0] for rank in per_rank)
        direct = statistics.fmean(rank[index][1] for rank in per_rank)
        exposed = statistics.fmean(rank[index][2] for rank in per_rank)
        wall = statistics.fmean(rank[index][3] for rank in per_rank)
        counted = sorted({rank[index][4] for rank in per_rank})
        ratio = reported / direct if direct > 0 else None
        exposed_share = exposed / wall if wall > 0 else None
        rows.append({"bytes": size, "count": plan.accuracy_count, "reported_comm_s": reported,
                     "direct_comm_s": direct, "comm_ratio": ratio, "exposed_s": exposed, "wall_s": wall,
                     "exposed_ratio": exposed_share, "bytes_counted": counted})
        table_rows.append([_size(size), ms(reported), ms(direct), number(ratio, ".3f"), number(exposed_share, ".3f")])
        checks.append(Check(f"all-reduce bytes counted once each ({_size(size)})", "correctness",
                            counted == [plan.accuracy_count * size],
                            f"{counted} counted, {plan.accuracy_count} x {size} expected"))
        passed = None if degenerate or ratio is None else abs(ratio - 1) <= ACCURACY_TOLERANCE
        checks.append(Check(f"reported all-reduce time within {ACCURACY_TOLERANCE:.0%} of direct ({_size(size)})",
                            "target", passed, ("1 rank: nothing crosses a link; " if degenerate else "")
                            + f"ratio {number(ratio, '.3f')}, exposed/wall {number(exposed_share, '.3f')}"))
    print(table(["message", "reported", "direct", "ratio", "exposed/wall"], table_rows))
    print(f"({plan.accuracy_count} blocking all-reduces per step, mean over {lab.world_size} rank(s); direct: "
          f"{'CUDA events around each call' if plan.cuda else 'perf_counter around each call'})")
    return {"ranks": lab.world_size, "degenerate": degenerate, "rows": rows}


# -- the run ---------------------------------------------------------------------------


def run_part(name: str, function, lab: Lab, plan: Plan, checks: list[Check], results: dict, *extra) -> None:
    print(f"\n== {name.replace('_', ' ')} on {lab.world_size} {plan.backend} rank(s) ==", flush=True)
    began = time.monotonic()
    try:
        results[name] = function(lab, plan, checks, *extra)
    except Exception as error:
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
        results["errors"][name] = message
        checks.append(Check(f"{name}: ran to the end", "correctness", False, message[:400]))
    results["part_seconds"][name] = round(time.monotonic() - began, 1)
    print(f"({name} took {results['part_seconds'][name]:.0f} s)", flush=True)


def run_on_lab(ranks: int, parts: list[str], plan: Plan, checks: list[Check], results: dict, env: dict) -> None:
    """Start one lab, run ``parts`` on it, stop it, whatever happens."""
    functions = {"performance": performance, "correctness": correctness, "mixed_precision": mixed_precision,
                 "collective": collective, "instrument_accuracy": instrument_accuracy}
    try:
        with Lab(ranks=ranks, backend=plan.backend, timeout=plan.lab_timeout, start_timeout=plan.start_timeout) as lab:
            print(f"\nlab of {ranks} {plan.backend} rank(s) ready in {lab.started_seconds:.1f} s", flush=True)
            for part in parts:
                extra = (env,) if part == "performance" else ()
                run_part(part, functions[part], lab, plan, checks, results, *extra)
    except Exception as error:  # the lab did not start, or did not stop
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
        for part in parts:
            if part not in results and part not in results["errors"]:
                results["errors"][part] = f"lab of {ranks} rank(s) failed: {message}"
        checks.append(Check(f"lab of {ranks} {plan.backend} rank(s) starts and stops", "correctness", False,
                            message[:400]))


def summarize(checks: list[Check]) -> bool:
    """Print the verdicts; True when no correctness check failed."""
    print("\n== checks ==")
    for check in checks:
        print(f"{check.verdict}  [{check.kind}] {check.name}: {check.detail}")
    failed = [check for check in checks if check.kind == "correctness" and check.passed is False]
    missed = [check for check in checks if check.kind == "target" and check.passed is False]
    print(f"\n{len(failed)} correctness check(s) failed, {len(missed)} performance target(s) missed", flush=True)
    return not failed


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run every part on gloo/CPU with tiny sizes (tests the script without a GPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the JSON (default {RESULTS.relative_to(ROOT)}; "
                             "a dry run writes to the temp directory)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each performance variant")
    parser.add_argument("--performance-budget", type=float, default=200.0,
                        help="seconds for the performance part: no new round once another would pass it")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    options = parser.parse_args(argv)
    options.parts = [part.strip() for part in options.parts.split(",") if part.strip()]
    unknown = sorted(set(options.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    if options.repeats < 1:
        parser.error("--repeats must be at least 1")
    return options


def main(argv=None) -> int:
    options = parse_arguments(argv)
    began = time.monotonic()
    info = environment()
    print_environment(info)
    if not options.cpu_dry_run and info["gpu_count"] == 0:
        print("no CUDA GPU is visible (torch.cuda.is_available() is False): this check measures the nccl path "
              "on GPUs. Run it on a machine with one, or pass --cpu-dry-run to test the script on gloo/CPU.",
              file=sys.stderr)
        return 2
    if options.cpu_dry_run:
        plan = dry_plan(options.repeats, options.performance_budget)
    else:
        plan = gpu_plan(info["gpu_count"], options.repeats, options.performance_budget)
    out = options.out or (Path(tempfile.gettempdir()) / "labkit-gpu-dry-run.json" if plan.dry_run else RESULTS)
    env = use_this_checkout()
    checks: list[Check] = []
    results: dict = {"errors": {}, "part_seconds": {}}
    first = [part for part in options.parts if part == "performance"]
    rest = [part for part in options.parts if part != "performance"]
    if first and plan.check_ranks == 1:  # one GPU: one lab for everything
        run_on_lab(1, first + rest, plan, checks, results, env)
    else:
        if first:
            run_on_lab(1, first, plan, checks, results, env)
        if rest:
            run_on_lab(plan.check_ranks, rest, plan, checks, results, env)
    passed = summarize(checks)
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "dry_run": plan.dry_run,
        "gpu": info["gpus"][0] if info["gpus"] and not plan.dry_run else None,
        "environment": info, "plan": asdict(plan), "seconds": round(time.monotonic() - began, 1),
        **{part: results.get(part) for part in PARTS},
        "errors": results["errors"], "part_seconds": results["part_seconds"],
        "checks": [dict(asdict(check), verdict=check.verdict.strip()) for check in checks],
        "passed": passed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out} ({record['seconds']:.0f} s in all)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
