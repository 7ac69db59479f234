"""The parameter server on 4 real gloo ranks: synchronous equals DDP, asynchronous stays within its staleness
bound, the servers carry the traffic, bad settings are refused, the magics and resume work.

One lab for the module, started through ``%lab start`` so the magics and the Python API share it.
"""

import math
import statistics
import time

import pytest
import torch

from labkit import LabConfigError
from labkit.strategies.ps_gate import staleness_bound
from labkit.wire.entry import this_rank

from tests.conftest import lab_shell

pytestmark = pytest.mark.lab

SMALL_MLP = dict(dims=(16, 64, 64, 64, 16))  # 10,448 parameters in 8 tensors
MODEL_BYTES = 10_448 * 4


@pytest.fixture(scope="module")
def shell():
    with lab_shell("4 --backend gloo --threads 1 --timeout 60") as ip:
        yield ip


@pytest.fixture(scope="module")
def lab(shell):
    return shell.user_ns["lab"]


def held_parameters():
    """What this rank holds, by name, as float64 (a server: its flat shard; a worker: the model)."""
    state = this_rank().train_state
    return state.parallel.role, {name: p.detach().double().clone() for name, p in state.parallel.named_parameters()}


def _checksum(parameters: dict) -> tuple[float, float]:
    """Sums of magnitudes and of squares: both far from zero, so a relative tolerance means something."""
    return (sum(float(p.abs().sum()) for p in parameters.values()),
            sum(float((p * p).sum()) for p in parameters.values()))


@pytest.mark.parametrize("servers", [1, 2])
def test_synchronous_equals_one_process_and_ddp(lab, servers):
    common = dict(steps=3, global_batch=24, model_settings=SMALL_MLP, log_every=100)
    report = lab.train("ps", "mlp", servers=servers, verify=True, **common)
    assert report.equivalent, str(report)
    assert report.equivalence_bound <= 1e-4 and report.verify["model_moved"] > 1e-3
    roles = ["server"] * servers + ["worker"] * (4 - servers)
    assert [result["role"] for result in report.results] == roles
    # Each rank compared what it holds: a server its one flat shard, a worker the model's 8 tensors.
    compared = [result["verify"]["parameters_compared_here"] for result in report.results]
    assert compared == [1] * servers + [8] * (4 - servers)
    held = lab.run(held_parameters)
    ddp = lab.train("ddp", "mlp", **common)
    reference = _checksum(lab.run(held_parameters)[0][1])
    for role, parameters in held[servers:]:
        assert _checksum(parameters) == pytest.approx(reference, rel=1e-6)
    assert report.losses == pytest.approx(ddp.losses, rel=1e-5)
    # The servers' shards together are one model; the optimizer state lives on them alone.
    memory = report.memory
    assert sum(m["params"] for m in memory[:servers]) == memory[-1]["params"] == MODEL_BYTES
    assert all(m["optimizer"] >= 2 * m["params"] for m in memory[:servers])
    assert all(m["optimizer"] == 0 for m in memory[servers:])
    assert report.strategy_results[0]["staleness"] == [0, 0, 0]  # one averaged update per step, never stale


@pytest.mark.parametrize("staleness, instruments", [(1, True), (2, False)])
def test_asynchronous_trains_within_the_staleness_bound(lab, staleness, instruments):
    steps, workers = 16, 3
    report = lab.train("ps", "mlp", steps=steps, staleness=staleness, global_batch=48, lr=1e-2,
                       model_settings=SMALL_MLP, instruments=instruments, log_every=100)
    losses = report.losses
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    assert statistics.fmean(losses[-4:]) < statistics.fmean(losses[:4]) - 0.05, losses
    server, *others = report.strategy_results
    applied = server["staleness"]
    assert len(applied) == steps * workers  # every push of every worker applied once
    assert server["staleness_bound"] == staleness_bound(workers, staleness)
    assert max(applied) <= staleness_bound(workers, staleness), applied
    assert max(applied) >= 1  # applied in arrival order: the round's later pushes are stale
    assert others == [{}, {}, {}]
    assert f"shard0: {steps * workers} updates applied" in str(report)


def test_the_servers_carry_the_traffic(lab):
    report = lab.train("ps", "mlp", steps=5, global_batch=24, model_settings=SMALL_MLP, log_every=100)
    per_rank = [statistics.fmean(sum(row["bytes"].values()) for row in result["rows"][1:])
                for result in report.results]
    assert per_rank[1:] == [2 * MODEL_BYTES] * 3  # a worker pushes its gradient and pulls the weights
    assert per_rank[0] == 3 * per_rank[1]  # the server does so with each of the 3 workers
    assert set(report.results[0]["rows"][-1]["bytes"]) == {"send", "recv"}


def test_bad_settings_are_refused_before_any_rank_works(lab):
    for settings, message in [
        (dict(servers=4), "servers=4 on 4 ranks leaves no worker"),
        (dict(staleness=1, verify=True), "nothing deterministic to compare with"),
        (dict(global_batch=32), "split evenly into 3 data-parallel replicas"),
        (dict(strategy="ps+tp"), "ps runs alone"),
    ]:
        with pytest.raises(LabConfigError, match=message):
            lab.train(**{"strategy": "ps", "model": "mlp", "steps": 1, **settings})
    lab.train("ps", "mlp", steps=1, global_batch=12, model_settings=SMALL_MLP, log_every=100)
    with pytest.raises(LabConfigError, match="cannot save the last run: ps keeps no checkpoints yet"):
        lab.save("/nonexistent/ps-checkpoint")
    assert lab.run(lambda: 1) == [1] * 4  # nothing was left half done


def test_the_magics_train_it(shell, capsys):
    report = shell.run_line_magic("lab", "train --strategy ps --model mlp --servers 2 --staleness 1 --steps 4")
    assert report.config.options == {"servers": 2, "staleness": 1} and report.steps_done == 4
    assert [result["role"] for result in report.results] == ["server", "server", "worker", "worker"]
    assert [len(result.get("staleness", [])) for result in report.strategy_results] == [8, 8, 0, 0]
    assert "step    4/4" in capsys.readouterr().out
    with pytest.raises(LabConfigError, match="nothing deterministic"):
        shell.run_line_magic("lab", "train --strategy ps --staleness 1 --verify --steps 1")


def test_a_continued_run_ends_where_one_run_ends(lab):
    common = dict(servers=2, global_batch=24, model_settings=SMALL_MLP, log_every=100)
    lab.train("ps", "mlp", steps=5, **common)
    one_run = lab.run(held_parameters)
    lab.train("ps", "mlp", steps=2, **common)
    continued = lab.train(steps=3, resume=True, verify=True, log_every=100)
    assert continued.config.first_step == 2 and continued.equivalent, str(continued)
    for (_, expected), (_, got) in zip(one_run, lab.run(held_parameters)):
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    lab.train("ps", "mlp", steps=4, staleness=1, **common)
    going_on = lab.train(steps=4, resume=True, log_every=100)  # asynchronous: continues, versions and all
    assert going_on.config.first_step == 4 and len(going_on.strategy_results[0]["staleness"]) == 4 * 2
    assert all(math.isfinite(loss) for loss in going_on.losses)


def test_a_stop_lands_on_an_agreed_step_with_every_push_applied(lab):
    run = lab.train("ps", "mlp", steps=100_000, staleness=2, global_batch=24, model_settings=SMALL_MLP,
                    log_every=100_000, background=True)
    time.sleep(1.5)
    run.stop()
    report = run.wait(60)
    assert report.stopped_early and report.steps_done % 4 == 0  # the ranks agree every 4 steps
    assert len(report.strategy_results[0]["staleness"]) == report.steps_done * 3  # nothing held or lost
