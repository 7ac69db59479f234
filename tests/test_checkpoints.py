"""Checkpoints, kill, heal and auto_heal on real ranks and real files (torch.distributed.checkpoint).

Every comparison is bitwise on CPU: a checkpoint holds exact copies, so going on
from one must end exactly where an uninterrupted run ends.
"""

import os
import signal
import time

import pytest
import torch

from labkit import Lab, LabConfigError, RankFailure
from labkit.rank.entry import this_rank

pytestmark = pytest.mark.lab


def whole_parameters():
    """Every parameter gathered whole, by name, and the state's step."""
    from torch.distributed.tensor import DTensor

    from labkit.rank.entry import this_rank as rank_runtime

    state = rank_runtime().train_state
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for name, p in state.parallel.named_parameters()}, state.step


def same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


def test_a_checkpoint_loads_on_another_rank_count_and_strategy_with_equal_tensors(lab, tmp_path):
    lab.train("fsdp", "gpt", steps=4, log_every=100)
    saved, step = lab.run(whole_parameters)[0]
    path = lab.save(str(tmp_path / "four"))
    assert lab.save(str(tmp_path / "four")) == path  # the same step again: no error, no hang
    assert sorted(os.listdir(tmp_path)) == ["four"]  # nothing partial left beside it
    with Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=60) as two:
        config = two.load(path)
        assert config.mesh.describe() == "dp=2" and config.strategy == "fsdp"
        assert all(same(saved, got) and at == step for got, at in two.run(whole_parameters))
        two.train(steps=2, resume=True, log_every=100)
        two.save(str(tmp_path / "two"))
        moved = two.run(whole_parameters)[0][0]
    config = lab.load(str(tmp_path / "two"), strategy="ddp")  # 2 -> 4 ranks, and FSDP -> DDP
    assert config.strategy == "ddp"
    assert all(same(moved, got) and at == step + 2 for got, at in lab.run(whole_parameters))


def test_checkpoints_refuse_what_does_not_fit(lab, tmp_path):
    lab.train("ddp", "mlp", steps=1, log_every=100)
    path = lab.save(str(tmp_path / "mlp"))
    with pytest.raises(LabConfigError, match="holds another model: model is 'mlp' in the checkpoint, 'gpt' here"):
        lab.load(path, model="gpt")
    with pytest.raises(LabConfigError, match=r"model_settings is .* in the checkpoint"):
        lab.load(path, model_settings=dict(dims=(128, 64, 128)))
    with pytest.raises(LabConfigError, match="no checkpoint at"):
        lab.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LabConfigError, match="no complete checkpoint in"):
        lab.load(str(tmp_path / "empty"))


def test_a_save_cut_short_leaves_the_previous_checkpoint(lab, tmp_path):
    lab.train("ddp", "mlp", steps=2, log_every=100)
    path = lab.save(str(tmp_path / "ckpt"))
    before = lab.run(whole_parameters)[0][0]
    lab.train(steps=2, resume=True, log_every=100)

    def die_while_saving():
        import os as _os

        import labkit.rank.checkpoint as checkpoint
        from labkit.rank.entry import this_rank as rank_runtime

        if rank_runtime().rank == 1:
            real = checkpoint.dcp.save

            def save_then_die(*args, **kwargs):
                real(*args, **kwargs)
                _os.kill(_os.getpid(), 9)  # the shards are written, the checkpoint is not complete

            checkpoint.dcp.save = save_then_die

    lab.run(die_while_saving)
    with pytest.raises(RankFailure, match="rank 1 died"):
        lab.save(path)
    assert any(name.startswith(".partial-") for name in os.listdir(tmp_path))
    lab.load(path)  # the old one, whole; the partial one ignored
    assert all(same(before, got) and step == 2 for got, step in lab.run(whole_parameters))


def _after_first_checkpoint(directory, run) -> None:
    """Wait (bounded) until the run has saved its first checkpoint, and a step more."""
    deadline = time.monotonic() + 60
    while not (directory / "step-00000006" / "labkit.json").exists() and time.monotonic() < deadline:
        assert not run.done, run.status()
        time.sleep(0.05)
    time.sleep(0.2)


def _train_with_checkpoints(lab, directory, **extra):
    return lab.train("fsdp", "mlp", steps=24, log_every=1000, checkpoint_every=6, checkpoint_dir=str(directory),
                     **extra)


def test_auto_heal_goes_on_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(lab, tmp_path):
    lab.train("fsdp", "mlp", steps=24, log_every=1000)
    uninterrupted = lab.run(whole_parameters)[0][0]
    lab.slow(2, 0.05)  # ~70 ms a step: the kill lands mid-run
    try:
        run = _train_with_checkpoints(lab, tmp_path, auto_heal=True, background=True)
        _after_first_checkpoint(tmp_path, run)
        killed_at = time.monotonic()
        lab.kill(1)
        report = run.wait(120)
    finally:
        lab.slow(2, None)
    assert len(report.notes) == 1 and "rank 1 died" in report.notes[0] and "restart 1 of 3" in report.notes[0]
    resumed_from = report.config.first_step
    assert resumed_from in (6, 12, 18) and report.steps_done == 24 - resumed_from
    assert time.monotonic() - killed_at < 60
    assert all(same(uninterrupted, got) and step == 24 for got, step in lab.run(whole_parameters))
    assert sorted(os.listdir(tmp_path)) == [f"step-{step:08d}" for step in (6, 12, 18, 24)]


def test_without_auto_heal_a_kill_fails_the_run_and_heal_finishes_it(lab, tmp_path):
    lab.slow(2, 0.05)
    try:
        run = _train_with_checkpoints(lab, tmp_path, background=True)
        _after_first_checkpoint(tmp_path, run)
        lab.kill(3)
        with pytest.raises(RankFailure, match="rank 3 died"):
            run.wait(60)
        assert run.status().startswith("failed after step")
        continued = lab.heal().wait(120)  # in the background, as the failed run was
    finally:
        lab.slow(2, None)
    assert continued.config.first_step in (6, 12, 18) and continued.config.first_step + continued.steps_done == 24
    assert [step for _, step in lab.run(whole_parameters)] == [24] * 4
    assert lab.heal() is None  # nothing left to finish


def test_auto_heal_stops_saying_so_when_its_restarts_are_spent(lab, tmp_path):
    lab.slow(2, 0.05)
    try:
        run = _train_with_checkpoints(lab, tmp_path, auto_heal=True, max_restarts=1, background=True)
        _after_first_checkpoint(tmp_path, run)
        lab.kill(1)
        deadline = time.monotonic() + 60
        while not (run.heals and run.status().startswith("running")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        lab.kill(1)  # the fresh rank 1, killed again: the one restart is spent
        with pytest.raises(RankFailure) as failure:
            run.wait(60)
    finally:
        lab.slow(2, None)
    notes = "\n".join(getattr(failure.value, "__notes__", []))
    assert "restart 1 of 1" in notes and "gave up after 1 restarts (max_restarts)" in notes


def test_the_fault_magics(lab, tmp_path):
    from .conftest import ipython_shell

    shell = ipython_shell()
    shell.user_ns["lab"] = None
    magics = shell.magics_manager.registry.get("LabMagics")
    if magics is None:
        shell.run_line_magic("load_ext", "labkit")
        magics = shell.magics_manager.registry["LabMagics"]
    magics.lab = lab
    lab.train("ddp", "mlp", steps=2, log_every=100)
    shell.run_line_magic("lab", f"checkpoint save {tmp_path / 'm'}")
    shell.run_line_magic("lab", f"checkpoint load {tmp_path / 'm'}")
    victim = lab.status().ranks[2].pid
    shell.run_line_magic("lab", "kill 2")
    psutil = pytest.importorskip("psutil")
    psutil.wait_procs([psutil.Process(victim)], 5)
    shell.run_line_magic("lab", "heal")
    assert lab.status().healthy and lab.run(lambda: this_rank().rank) == [0, 1, 2, 3]
    magics.lab = None


def test_only_the_newest_checkpoints_are_kept_when_asked(lab, tmp_path):
    lab.train("ddp", "mlp", steps=8, log_every=100, checkpoint_every=2, checkpoint_dir=str(tmp_path),
              keep_checkpoints=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000006", "step-00000008"]
    with pytest.raises(LabConfigError, match="keep_checkpoints must be a positive integer"):
        lab.train("ddp", "mlp", steps=2, checkpoint_every=1, checkpoint_dir=str(tmp_path), keep_checkpoints=0)
