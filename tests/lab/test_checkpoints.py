"""Checkpoints, kill, heal and auto_heal on real ranks and real files (torch.distributed.checkpoint).

Every comparison is bitwise on CPU: a checkpoint holds exact copies, so going on
from one must end exactly where an uninterrupted run ends.
"""

import os
import signal
import time

import pytest
import torch

from labkit import Lab, LabBusy, LabConfigError, RankFailure
from labkit.wire.entry import this_rank

pytestmark = pytest.mark.lab


def whole_parameters():
    """Every parameter gathered whole, by name, and the state's step."""
    from torch.distributed.tensor import DTensor

    from labkit.wire.entry import this_rank as rank_runtime

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
        from labkit.wire.entry import this_rank as rank_runtime

        if rank_runtime().rank == 1:
            real = checkpoint.dcp.save

            def save_then_die(*args, **kwargs):
                real(*args, **kwargs)
                _os.kill(_os.getpid(), 9)  # the shards are written, the checkpoint is not complete

            checkpoint.dcp.save = save_then_die

    lab.run(die_while_saving)
    with pytest.raises(RankFailure, match=r"the save to .*ckpt did not complete: the checkpoint there \(step 2\) is "
                                          r"intact, and nothing half-written is left; .*rank 1 died"):
        lab.save(path)
    assert os.listdir(tmp_path) == ["ckpt"]  # what the cut save wrote is gone
    lab.load(path)  # the old one, whole
    assert all(same(before, got) and step == 2 for got, step in lab.run(whole_parameters))
    lab.save(path)
    assert os.listdir(tmp_path) == ["ckpt"]


def _slow_down_the_next_write():
    """On this rank: the next DCP write waits 3 s first (inside DCP, where an interrupt lands in a real save)."""
    import time as _time

    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        FileSystemWriter.write_data = real  # once
        _time.sleep(3)
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data


def test_ctrl_c_during_a_save_says_the_save_was_cut_and_the_old_checkpoint_is_intact(lab, tmp_path):
    import _thread
    import threading

    from labkit.runs.save_outcome import SaveInterrupted

    lab.train("ddp", "mlp", steps=2, log_every=100)
    path = lab.save(str(tmp_path / "ckpt"))
    before = lab.run(whole_parameters)[0][0]
    lab.train(steps=2, resume=True, log_every=100)
    lab.run(_slow_down_the_next_write)
    threading.Timer(1.0, _thread.interrupt_main).start()  # the notebook's stop button, mid-write
    with pytest.raises(KeyboardInterrupt) as cut:
        lab.save(path)
    said = str(cut.value)
    assert isinstance(cut.value, SaveInterrupted), said
    assert said.startswith(f"the save to {path} was cut by the interrupt: the checkpoint there (step 2) is intact, "
                           "and nothing half-written is left; ranks 0, 1, 2, 3 interrupted"), said
    assert "CheckpointException" not in said
    assert os.listdir(tmp_path) == ["ckpt"]
    lab.load(path)
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
    assert sorted(os.listdir(tmp_path)) == [f"step-{step:08d}" for step in (12, 18, 24)]  # the newest 3 kept


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
    from tests.conftest import ipython_shell

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


# -- a save never loses anything ----------------------------------------------------------------------------------


def test_a_save_never_deletes_or_moves_what_is_not_a_checkpoint(lab, tmp_path):
    lab.train("ddp", "mlp", steps=1, log_every=100)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    (work / "data" / "train.csv").write_text("1,2")
    with pytest.raises(LabConfigError, match=r"holds data/, notes.txt \(2 entries\).*another path"):
        lab.save(str(work))
    assert (work / "notes.txt").read_text() == "mine" and (work / "data" / "train.csv").read_text() == "1,2"
    (tmp_path / "file.pt").write_text("mine")
    with pytest.raises(LabConfigError, match="is a file, not a checkpoint"):
        lab.save(str(tmp_path / "file.pt"))
    assert sorted(os.listdir(tmp_path)) == ["file.pt", "work"]  # nothing moved aside, nothing hidden beside
    path = lab.save(str(tmp_path / "ckpt"))
    os.symlink(path, tmp_path / "link")
    with pytest.raises(LabConfigError, match="symbolic link"):
        lab.save(str(tmp_path / "link"))
    with pytest.raises(LabConfigError, match="inside the checkpoint"):
        lab.save(os.path.join(path, "inner"))
    (tmp_path / "empty").mkdir()
    lab.save(str(tmp_path / "empty"))  # an empty folder is fine to use
    lab.save(str(tmp_path / "new" / "deeper"))  # and missing parents are made
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty", "file.pt", "link", "new", "work"]
    assert os.path.islink(tmp_path / "link") and (tmp_path / "file.pt").read_text() == "mine"


def _kill_rank_0_during_the_replacement(instant):
    """On rank 0: SIGKILL this process at ``instant`` of the next save's replacement of the old checkpoint."""
    import os as _os

    import labkit.rank.checkpoint_swap as swap
    from labkit.wire.entry import this_rank as rank_runtime

    if rank_runtime().rank != 0:
        return

    def die():
        _os.kill(_os.getpid(), 9)

    real_exchange, real_move = swap.exchange, swap.move
    if instant == "before the exchange":
        swap.exchange = lambda first, second: die()
    elif instant == "after the exchange":
        swap.exchange = lambda first, second: (real_exchange(first, second), die())
    elif instant == "removing the old one":
        def remove_some(path):
            _os.remove(_os.path.join(path, "labkit.json"))
            _os.remove(_os.path.join(path, sorted(_os.listdir(path))[-1]))
            die()

        swap.remove_checkpoint = remove_some
    elif instant == "between two renames":  # where the system cannot exchange two folders at once
        swap.exchange = lambda first, second: False
        moved = []

        def move_then_die(source, destination):
            if moved:
                die()
            moved.append(real_move(source, destination))

        swap.move = move_then_die


@pytest.mark.parametrize("instant, finds", [("before the exchange", "old"), ("after the exchange", "new"),
                                            ("removing the old one", "new"), ("between two renames", "new")])
def test_a_kill_at_any_instant_of_a_replacement_leaves_a_whole_checkpoint(lab, tmp_path, instant, finds):
    lab.train("ddp", "mlp", steps=2, log_every=100)
    path = lab.save(str(tmp_path / "ckpt"))
    old = lab.run(whole_parameters)[0][0]
    lab.train(steps=2, resume=True, log_every=100)
    new = lab.run(whole_parameters)[0][0]
    lab.run(_kill_rank_0_during_the_replacement, instant)
    with pytest.raises(RankFailure, match="rank 0 died"):
        lab.save(path)
    lab.load(path)
    expected, step = (old, 2) if finds == "old" else (new, 4)
    assert all(same(expected, got) and at == step for got, at in lab.run(whole_parameters))
    assert lab.save(path) == path  # the next save tidies what the cut one left
    assert os.listdir(tmp_path) == ["ckpt"]


# -- a damaged checkpoint says what is wrong, where, and what to do --------------------------------------------------


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_checkpoints_to_load_instead(lab, tmp_path):
    run = tmp_path / "run"
    lab.train("ddp", "mlp", steps=4, log_every=100, checkpoint_every=2, checkpoint_dir=str(run))
    newest = run / "step-00000004"
    meta = newest / "labkit.json"
    good = meta.read_bytes()
    instead = r"load another one, e\.g\. .*step-00000002"
    meta.write_bytes(b"\xff\xfe" + os.urandom(62))
    with pytest.raises(LabConfigError, match=rf"step-00000004/labkit.json is not readable.*{instead}"):
        lab.load(str(newest))
    meta.write_text("{}")
    with pytest.raises(LabConfigError, match=rf"step-00000004/labkit.json lacks .*settings.*{instead}"):
        lab.load(str(run))  # the newest in the folder: the same refusal
    meta.write_bytes(good)
    shard = sorted(newest.glob("*.distcp"))[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(LabConfigError, match=rf"{shard.name} is cut short.*{instead}"):
        lab.load(str(newest))
    shard.unlink()
    with pytest.raises(LabConfigError, match=rf"{shard.name} is missing.*{instead}"):
        lab.load(str(newest))
    with pytest.raises(LabConfigError, match="is a file, not a checkpoint.*give its folder"):
        lab.load(str(meta))
    lab.load(str(run / "step-00000002"))  # the older one, whole
    assert [step for _, step in lab.run(whole_parameters)] == [2] * 4


def _flip_64_bytes_in_the_middle(path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - byte for byte in data[middle:middle + 64])
    path.write_bytes(bytes(data))  # the same size: only a checksum tells


def test_flipped_bytes_in_a_shard_are_named_with_the_rank_that_wrote_it_and_nothing_is_loaded(lab, tmp_path, capsys):
    import json

    lab.train("fsdp", "mlp", steps=2, log_every=100)
    path = lab.save(str(tmp_path / "ckpt"))
    lab.train(steps=2, resume=True, log_every=100)
    held = lab.run(whole_parameters)
    shard = tmp_path / "ckpt" / "__2_0.distcp"
    whole = shard.read_bytes()
    _flip_64_bytes_in_the_middle(shard)
    with pytest.raises(LabConfigError, match=r"ckpt/__2_0.distcp \(written by rank 2\) does not match its checksum "
                                             r"\(sha256 .*its bytes changed since the save: the checkpoint .* is "
                                             r"damaged, so nothing was loaded"):
        lab.load(path)
    assert all(same(held[0][0], got) and step == 4 for got, step in lab.run(whole_parameters))  # unchanged
    shard.write_bytes(whole)
    meta = tmp_path / "ckpt" / "labkit.json"
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "step": -5}))
    with pytest.raises(LabConfigError, match=r"ckpt/labkit.json has step -5, which no save writes .*nothing was "
                                             r"loaded"):
        lab.load(path)
    assert all(same(held[0][0], got) and step == 4 for got, step in lab.run(whole_parameters))
    del record["files"]  # as a save before checksums wrote it
    meta.write_text(json.dumps(record))
    capsys.readouterr()
    lab.load(path)
    assert capsys.readouterr().out.count("saved without checksums") == 1
    assert [step for _, step in lab.run(whole_parameters)] == [2] * 4


def test_an_fsdp_checkpoint_loads_under_pp_with_a_microbatch_per_stage(lab, tmp_path):
    lab.train("fsdp", "gpt", steps=1, log_every=100)
    path = lab.save(str(tmp_path / "fsdp"))
    config = lab.load(path, strategy="pp")
    assert config.strategy == "pp" and config.micro_batches == 4 and config.mesh.describe() == "pp=4"
    with pytest.raises(LabConfigError, match=r"pass micro_batches=4 or more .*schedule='gpipe'"):
        lab.load(path, strategy="pp", micro_batches=2)


# -- while a run trains, and what a run keeps -----------------------------------------------------------------------


def test_a_save_during_a_background_run_says_the_lab_is_busy(tmp_path):
    with Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=60) as two:  # a fresh lab: no state saved yet
        run = two.train("ddp", "mlp", steps=100000, log_every=100000, background=True)
        try:
            with pytest.raises(LabBusy, match=r"run\.wait\(\).*run\.stop\(\)"):
                two.save(str(tmp_path / "ckpt"))
        finally:
            run.stop()
            run.wait(60)
        two.save(str(tmp_path / "ckpt"))  # once it has stopped, its state
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_run_keeps_its_newest_three_checkpoints_by_default_saying_so_once_and_touches_nothing_else(
        lab, tmp_path, capsys):
    lab.train("ddp", "mlp", steps=1, log_every=100)
    lab.save(str(tmp_path / "by-hand"))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-00000001").mkdir()  # a folder of the user's that happens to look like one
    (tmp_path / "step-00000001" / "notes.txt").write_text("mine")
    capsys.readouterr()
    lab.train("ddp", "mlp", steps=10, log_every=100, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    said = capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["by-hand", "notes.txt", "step-00000001", "step-00000006",
                                            "step-00000008", "step-00000010"]
    assert said.count("keeping the newest 3 checkpoints") == 1 and "keep_checkpoints" in said
