"""Your own model through the lab against a loop written by hand on the same ranks.

    ./lab bench own_model [--steps 60] [--repeats 5]

Two user models: a small CNN on scikit-learn's digits (real data in its wheel) and a
2-layer Hugging Face Llama built from a config (character ids of the standard
library's own ``json`` sources), each under DDP and FSDP on 4 gloo ranks (``--ranks``) with one
thread each. For each pair, in one run and alternating which goes first:

- ``lab.train(strategy, model=..., data=...)`` with instruments off, and with them on;
- the same training written by hand in a cell on the same ranks (torch's DDP or
  ``fully_shard`` on each block, the same data shares, AdamW, the same batch),
  measured as the report measures: the slowest rank at each step, then the median.

Each repeat's ratio of median step times (slowest rank) to the hand loop's beside it,
then the median over repeats, is the lab's cost on a model it did not write (targets:
at most 1.03 with instruments off, 1.05 with them on); the spread is printed with it.
Also the wall time of ``lab.train(model=MyNet, steps=1)``: from the call to its
report, packing and sending the model included. Writes bench/results/own_model.json.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from results_file import write_results

from labkit import Lab

RESULTS = Path(__file__).resolve().parent / "results" / "own_model.json"
WIDTH = 16


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, WIDTH, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH * 16, 256), nn.Linear(256, 256)])
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
        for block in self.blocks:
            x = F.relu(block(x))
        return self.head(x)


def digits_data():
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    return TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))


def llama_parts():
    from transformers import LlamaConfig, LlamaForCausalLM

    stdlib = sysconfig.get_paths()["stdlib"]
    text = "".join(open(path, encoding="utf-8").read() for path in sorted(glob.glob(os.path.join(stdlib, "json",
                                                                                                  "*.py"))))
    alphabet = sorted(set(text))
    ids = torch.tensor([alphabet.index(c) for c in text])
    windows = ids[: len(ids) // 65 * 65].view(-1, 65)
    config = LlamaConfig(vocab_size=len(alphabet), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    from torch.utils.data import TensorDataset

    return (lambda: LlamaForCausalLM(config)), TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


# What a person writes by hand on the ranks: build, wrap, then time each step of the same batches.
HAND_LOOP = '''
import time
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

torch.manual_seed(0)
net = bench_model()
if bench_strategy == "ddp":
    net = DistributedDataParallel(net)
else:
    blocks = max((m for m in net.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    for block in blocks:
        fully_shard(block)
    fully_shard(net)
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)  # as the lab's AdamW
share = bench_batch // world_size
order = torch.randperm(len(bench_data), generator=torch.Generator().manual_seed(0))
times = []
for step in range(bench_steps):
    first = (step * bench_batch + rank * share) % len(bench_data)
    inputs, targets = bench_data[order[first:first + share]]
    began = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    output = net(inputs)
    logits = output.logits if hasattr(output, "logits") else output
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    optimizer.step()
    times.append(time.perf_counter() - began)
bench_times = times
'''


# The same hand loop, and the step ``lab.train`` takes on the state it built (its model on its mesh, its
# forward and backward with the loss, its optimizer step), alternated step by step in one cell: what the
# machine does meanwhile falls on both alike, which runs a few seconds apart do not share on 2 cores.
PAIRED_STEPS = HAND_LOOP.replace("times = []", """times = []
from labkit.wire.entry import this_rank
state = this_rank().train_state
lab_times = []""").replace("    began = time.perf_counter()", """    lab_first = step % 2 == 0
    if lab_first:
        lab_times.append(lab_step(state, (inputs, targets)))
    began = time.perf_counter()""").replace("bench_times = times", """    if not lab_first:
        lab_times.append(lab_step(state, (inputs, targets)))
bench_times, bench_lab_times = times, lab_times""")
PAIRED_STEPS = """
def lab_step(state, batch):
    began = time.perf_counter()
    state.optimizer.zero_grad(set_to_none=True)
    state.parallel.forward_backward(batch)
    state.parallel.optimizer_step(state.optimizer)
    state.finish_step()
    return time.perf_counter() - began
""" + PAIRED_STEPS


def hand_written(lab: Lab, strategy: str, model, data, steps: int, batch: int) -> float:
    lab.push(bench_model=model, bench_data=data, bench_strategy=strategy, bench_steps=steps, bench_batch=batch)
    lab.run_cell(HAND_LOOP, live=False)
    per_rank = lab.run(_times)
    # Measured as the lab's report measures: the slowest rank's time at each step, then the median (the
    # first step left out).
    slowest = [max(times[step] for times in per_rank) for step in range(1, steps)]
    return statistics.median(slowest)


def _times() -> list[float]:
    return globals()["bench_times"]  # on the rank: what HAND_LOOP left in its namespace


def paired(lab: Lab, strategy: str, model, data, steps: int, batch: int) -> tuple[float, float]:
    """Median step (slowest rank) of the hand loop and of the lab's step, alternated step by step."""
    lab.train(strategy, model=model, data=data, steps=1, global_batch=batch, lr=1e-3, instruments=False,
              log_every=10**9)  # builds the lab's state for this model and strategy
    lab.push(bench_model=model, bench_data=data, bench_strategy=strategy, bench_steps=steps, bench_batch=batch)
    lab.run_cell(PAIRED_STEPS, live=False)
    per_rank = lab.run(_both_times)
    return tuple(statistics.median(max(times[kind][step] for times in per_rank) for step in range(2, steps))
                 for kind in (0, 1))


def _both_times() -> tuple[list[float], list[float]]:
    names = globals()  # on the rank: what PAIRED_STEPS left in its namespace
    return names["bench_times"], names["bench_lab_times"]


def through_lab(lab: Lab, strategy: str, model, data, steps: int, batch: int, instruments: bool) -> float:
    report = lab.train(strategy, model=model, data=data, steps=steps, global_batch=batch, lr=1e-3,
                       instruments=instruments, log_every=10**9)
    return report.median_step_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4,
                        help="2 gives each rank a core of its own on a 2-core machine: less scheduling noise")
    parser.add_argument("--paired-steps", type=int, default=200,
                        help="steps of the run that alternates the hand loop's step and the lab's step")
    parser.add_argument("--strategies", default="ddp,fsdp", help="which of ddp,fsdp to compare")
    args = parser.parse_args()
    models = {"digits CNN": (DigitsCNN, digits_data(), 64)}
    try:
        llama, text = llama_parts()
        models["HF Llama (2 layers)"] = (llama, text, 16)
    except ImportError:
        print("transformers is not installed: the Llama rows are left out")
    rows = []
    with Lab(ranks=args.ranks, backend="gloo", threads_per_rank=1) as lab:
        began = time.perf_counter()
        lab.train("ddp", "mlp", steps=1, log_every=10**9)  # the lab's first run: meshes, DDP's first use
        zoo_first = time.perf_counter() - began
        began = time.perf_counter()
        lab.train("ddp", model=DigitsCNN, data=models["digits CNN"][1], steps=1, log_every=10**9)
        first_run = time.perf_counter() - began
        began = time.perf_counter()
        lab.train("ddp", model=DigitsCNN, data=models["digits CNN"][1], steps=1, log_every=10**9)
        again = time.perf_counter() - began
        for name, (model, data, batch) in models.items():
            for strategy in args.strategies.split(","):
                measured: dict[str, list[float]] = {"hand": [], "lab": [], "lab+instruments": []}
                for repeat in range(args.repeats):
                    order = ["hand", "lab", "lab+instruments"]
                    for kind in order[repeat % 3:] + order[:repeat % 3]:
                        if kind == "hand":
                            value = hand_written(lab, strategy, model, data, args.steps, batch)
                        else:
                            value = through_lab(lab, strategy, model, data, args.steps, batch,
                                                instruments=kind != "lab")
                        measured[kind].append(value)
                # Each repeat's ratio against the hand loop of the same repeat (run next to it), then the median.
                ratios = [lab_run / hand for lab_run, hand in zip(measured["lab"], measured["hand"])]
                with_instruments = [lab_run / hand for lab_run, hand in zip(measured["lab+instruments"],
                                                                             measured["hand"])]
                row = {"model": name, "strategy": strategy, "hand_ms": statistics.median(measured["hand"]) * 1000,
                       "lab_ms": statistics.median(measured["lab"]) * 1000,
                       "lab_instruments_ms": statistics.median(measured["lab+instruments"]) * 1000,
                       "ratio": statistics.median(ratios), "ratio_instruments": statistics.median(with_instruments),
                       "ratios": ratios, "ratios_instruments": with_instruments}
                hand_paired, lab_paired = paired(lab, strategy, model, data, args.paired_steps, batch)
                row.update(paired_hand_ms=hand_paired * 1000, paired_lab_ms=lab_paired * 1000,
                           paired_ratio=lab_paired / hand_paired)
                rows.append(row)
                print(f"{name:22s} {strategy:5s} hand {row['hand_ms']:7.2f} ms  lab {row['lab_ms']:7.2f} ms "
                      f"({row['ratio']:.3f}x, {min(ratios):.2f}-{max(ratios):.2f})  with instruments "
                      f"{row['lab_instruments_ms']:7.2f} ms ({row['ratio_instruments']:.3f}x, "
                      f"{min(with_instruments):.2f}-{max(with_instruments):.2f})  step by step: hand {hand_paired * 1000:.2f} ms, "
                      f"lab {lab_paired * 1000:.2f} ms ({row['paired_ratio']:.3f}x)", flush=True)
    print(f"lab.train(model=DigitsCNN, steps=1) on {args.ranks} ranks: {first_run:.2f} s the first time (after the lab's "
          f"first run, of the zoo's mlp: {zoo_first:.2f} s), {again:.2f} s again")
    write_results(RESULTS, {"rows": rows, "first_train_seconds": first_run, "again_train_seconds": again,
                            "zoo_first_train_seconds": zoo_first,
                                "steps": args.steps, "repeats": args.repeats, "ranks": args.ranks})


if __name__ == "__main__":
    main()
