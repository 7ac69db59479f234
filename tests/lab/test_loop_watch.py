"""Instruments on loops the lab did not write: torchrun scripts watched on 4 real ranks.

The scripts are the ones ``test_run_script`` runs against torchrun (a tutorial-style DDP trainer, FSDP2's
example) and a GAN-style loop with two optimizers that marks its own steps. Watched, each must print the
same digits as without instruments, and its report must hold what the loop really did: its steps, its
samples, its collectives by kind, its memory.
"""

import re
import time
from pathlib import Path

import pytest

from tests.lab.test_run_script import RESULT, SCRIPTS, WORKSHOP_SCRIPTS

pytestmark = pytest.mark.lab

GAN = re.compile(r"^(?:\[rank \d+\] )?(gan loss \S+ checksum \S+)$", re.MULTILINE)


def run_both(lab, capsys, script: Path, *args: str, pattern=RESULT):
    capsys.readouterr()
    lab.run_script(script, *args)
    plain = pattern.findall(capsys.readouterr().out)
    report = lab.run_script(script, *args, instruments=True)
    watched = pattern.findall(capsys.readouterr().out)
    assert len(plain) == 1 and watched == plain  # bitwise: the same digits with and without instruments
    return report, plain


def test_a_tutorial_ddp_trainer_shows_its_steps_samples_and_all_reduces(lab, capsys):
    report, _ = run_both(lab, capsys, WORKSHOP_SCRIPTS / "ddp_trainer.py", "--epochs", "3")
    assert report.steps_done == 3 * 8  # 8 batches per epoch: one row per optimizer step
    assert report.samples_per_step == 4 * 16  # each rank's batch of 16, as its DDP module saw it
    parameters = (20 * 32 + 32) + (32 + 1)
    # DDP all-reduces every gradient once per step, on each of the 4 ranks, in float32; in its second step it
    # also broadcasts the order of its rebuilt buckets, once.
    assert report.comm_bytes_per_step["all_reduce"] == 4 * 4 * parameters
    assert all(row["bytes"] == {"all_reduce": 4 * parameters} for row in report.rows[3][2:])
    assert set(report.rows[3][1]["bytes"]) == {"all_reduce", "broadcast"}
    assert all(memory["params"] == 4 * parameters and memory["optimizer"] == 0 for memory in report.memory)
    assert report.median_step_seconds > 0 and report.samples_per_second > 0
    assert report.notes == []
    rows = report.rows[2]
    assert [row["step"] for row in rows] == list(range(24))
    assert all(row["compute"] + row["exposed_comm"] == pytest.approx(row["seconds"]) for row in rows)
    assert "all_reduce" in str(report) and "24 steps" in str(report)
    timeline = report.timeline(3)
    assert [entry["step"] for entry in timeline.entries[0]] == [21, 22, 23]
    assert "last 3 steps" in timeline.title


def test_fsdp2s_example_shows_gathers_and_reduce_scatters_on_its_shards(lab, capsys):
    report, _ = run_both(lab, capsys, SCRIPTS / "fsdp2_example.py")
    assert report.steps_done == 4
    assert report.samples_per_step == 4 * 8
    assert {"all_gather", "reduce_scatter"} <= set(report.comm_bytes_per_step)
    shard = 3 * (24 * 24 + 24) * 4 // 4  # each rank keeps a quarter of the float32 parameters
    assert all(memory["params"] == shard for memory in report.memory)


def test_a_loop_that_marks_its_steps_and_logs_its_loss(lab, capsys):
    expected = GAN.findall(torchrun_output(SCRIPTS / "two_optimizers.py"))
    report, plain = run_both(lab, capsys, SCRIPTS / "two_optimizers.py", pattern=GAN)
    assert plain == expected  # labkit.step and labkit.log change nothing, and do nothing under torchrun
    assert report.steps_done == 6  # marked steps, not its 12 optimizer steps
    assert all(loss is not None and loss > 0 for loss in report.losses)
    assert all("generator_loss" in row["scalars"] for row in report.rows[0])
    assert report.samples_per_step == 4 * 12  # the first DDP module's forward (the generator's noise)


def torchrun_output(script: Path) -> str:
    import os

    from labkit import torchrun

    return torchrun(script, nproc=4, env=dict(os.environ, GLOO_SOCKET_IFNAME="lo")).stdout


def test_a_straggler_in_a_script_is_flagged_live_and_a_stop_ends_it_at_a_step_boundary(lab):
    run = lab.run_script(WORKSHOP_SCRIPTS / "ddp_trainer.py", "--epochs", "2000", dashboard=True, background=True)
    try:
        wait_for(lambda: (run.table.latest_step or 0) >= 30, "30 steps")
        lab.slow(2, 0.03)
        wait_for(lambda: run.table.flagged() == [2], "rank 2 flagged")
        # Counted on the rows (they reach the notebook a few times a second): from the first slowed step to
        # the step whose rows flag it.
        first_slow = min(step for step, row in run.table.rows[2].items() if row["delay"] > 0)
        flagged_at = min(step for rank, step, up in run.table.flag_events() if rank == 2 and up)
        assert 0 <= flagged_at - first_slow <= 10
        wait_for(lambda: "samples/s" in run.dashboard.header.value, "throughput on the dashboard")
        # What the largest rank holds: the trainer's 705 float32 parameters and their gradients (SGD keeps none).
        wait_for(lambda: "at most 5.6 kB per rank" in run.dashboard.header.value, "memory on the dashboard")
    finally:
        lab.slow(2, None)
        run.stop()
    report = run.wait()
    assert report.stopped and 0 < report.steps_done < 2000 * 8
    assert len({len(result["rows"]) for result in report.results}) == 1  # every rank stopped at the same step
    assert report.steps_done % 4 == 0  # the ranks agree on a stop every 4 steps
    assert any(row["delay"] > 0 for row in report.rows[2])
    assert run.dashboard.draws > 0 and "(stopped)" in run.dashboard.header.value
    assert lab.run(lambda: 5) == [5] * 4  # the lab is free again


def test_a_hand_written_fsdp_loop_in_a_cell_is_watched(lab):
    code = """
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    batch = torch.randn(5, 32)
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""
    report = lab.run_cell(code, instruments=True)
    assert report.steps_done == 6 and report.samples_per_step == 4 * 5
    assert {"all_gather", "reduce_scatter"} <= set(report.comm_bytes_per_step)
    per_rank = 4 * (32 * 32 + 32) * 4 // 4  # float32 shards, a quarter each
    # AdamW keeps two moments per shard, and a step count per parameter.
    assert all(memory["params"] == per_rank and 2 * per_rank <= memory["optimizer"] <= 2 * per_rank + 8 * 8
               for memory in report.memory)
    assert lab.run_cell("model is not None") == ["True"] * 4  # the cell's names stay on the ranks


def wait_for(condition, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {seconds:g} s")
        time.sleep(0.05)


def test_under_fsdp_and_tp_a_replicas_batch_is_counted_once(lab):
    # Both tensor-parallel ranks of a replica take the same 4 rows: 2 replicas make 8 samples a step, not 16.
    code = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    torch.manual_seed(100 * step + mesh["dp"].get_local_rank())
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
    report = lab.run_cell(code, instruments=True)
    assert report.steps_done == 4 and report.samples_per_step == 2 * 4
    assert all(row["samples"] == 2 for rows in report.rows.values() for row in rows)  # a share of its replica's


def test_a_watched_loop_without_an_optimizer_step_says_what_to_add(lab):
    report = lab.run_cell("total = sum(range(10))", instruments=True)
    assert report.steps_done == 0
    assert any("no step was seen: no optimizer stepped and no labkit.step() marked one" in note and
               "with labkit.step(samples=len(batch))" in note for note in report.notes)
