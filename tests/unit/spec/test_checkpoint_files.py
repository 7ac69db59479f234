"""Which paths a save may use, and what a cut-short replacement leaves: files only, no ranks.

A "checkpoint" here is a folder of the names a real one holds (``labkit.json``,
DCP's ``.metadata`` and shards, the random states), so the crash states a kill
leaves can be laid out by hand and looked at without a process.
"""

import json
import os

import pytest

from labkit.spec import checkpoint_files as files
from labkit.rank import checkpoint_swap as swap


def fake_checkpoint(path, step=1, complete=True):
    os.makedirs(path)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "random-state-rank0.pt", "random-state-rank1.pt"):
        with open(os.path.join(path, name), "w") as handle:
            handle.write(str(step))
    if complete:
        with open(os.path.join(path, files.META_FILE), "w") as handle:
            json.dump({"step": step, "world_size": 2, "settings": {"model": "mlp"}}, handle)
    return str(path)


def step_of(path):
    with open(os.path.join(path, files.META_FILE)) as handle:
        return json.load(handle)["step"]


# -- which paths a save may use ---------------------------------------------------------------------------------


def test_a_new_path_an_empty_folder_and_a_previous_checkpoint_may_be_saved_to(tmp_path):
    assert files.save_refusal(str(tmp_path / "new")) is None
    assert files.save_refusal(str(tmp_path / "not" / "yet" / "there")) is None  # parents are made
    (tmp_path / "empty").mkdir()
    assert files.save_refusal(str(tmp_path / "empty")) is None
    assert files.save_refusal(fake_checkpoint(tmp_path / "old")) is None


def test_a_folder_of_other_files_is_refused_naming_a_few_and_the_count(tmp_path):
    folder = tmp_path / "work"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "data" / "train.csv").write_text("1,2")
    refusal = files.save_refusal(str(folder))
    assert "data/, notes.txt (2 entries)" in refusal and "not a labkit checkpoint" in refusal
    assert "another path" in refusal
    for index in range(6):
        (folder / f"extra{index}").write_text("")
    assert "and 5 more (8 entries)" in files.save_refusal(str(folder))


def test_a_checkpoint_with_a_stranger_inside_is_refused_too(tmp_path):
    path = fake_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    assert "notes.txt (1 entry)" in files.save_refusal(path)


def test_a_file_a_link_a_folder_of_checkpoints_and_a_path_inside_a_checkpoint_are_refused(tmp_path):
    (tmp_path / "file").write_text("mine")
    assert "is a file, not a checkpoint" in files.save_refusal(str(tmp_path / "file"))
    assert "is a file" in files.save_refusal(str(tmp_path / "file" / "below"))
    real = fake_checkpoint(tmp_path / "real")
    os.symlink(real, tmp_path / "link")
    assert "symbolic link" in files.save_refusal(str(tmp_path / "link"))
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert "symbolic link" in files.save_refusal(str(tmp_path / "dangling"))
    fake_checkpoint(tmp_path / "run" / "step-00000002")
    refusal = files.save_refusal(str(tmp_path / "run"))
    assert "step-00000002/ (1 entry)" in refusal
    inside = files.save_refusal(str(tmp_path / "run" / "step-00000002" / "mine"))
    assert "inside the checkpoint" in inside and str(tmp_path / "run" / "mine") in inside
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / ".metadata").write_text("")
    assert "no labkit.json" in files.save_refusal(str(tmp_path / "raw"))


def test_descriptions_name_a_few_entries_and_count_them():
    assert files.describe_entries(["a"]) == "a (1 entry)"
    assert files.describe_entries(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more (5 entries)"


# -- what a replacement leaves, whichever instant it was cut ----------------------------------------------------


def test_removing_a_checkpoint_leaves_anything_else_in_it(tmp_path):
    path = fake_checkpoint(tmp_path / "old")
    assert files.remove_checkpoint(path) and not os.path.exists(path)
    path = fake_checkpoint(tmp_path / "shared")
    (tmp_path / "shared" / "notes.txt").write_text("mine")
    assert not files.remove_checkpoint(path)
    assert os.listdir(path) == ["notes.txt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_replacement_puts_the_new_checkpoint_in_place_and_leaves_nothing_beside_it(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(swap, "exchange", lambda first, second: False)
    target = fake_checkpoint(tmp_path / "ckpt", step=2)
    partial = fake_checkpoint(files.partial_directory(target), step=4)
    swap.put_in_place(partial, target)
    assert step_of(target) == 4 and os.listdir(tmp_path) == ["ckpt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    swap.put_in_place(fake_checkpoint(files.partial_directory(str(empty)), step=6), str(empty))
    assert step_of(str(empty)) == 6 and sorted(os.listdir(tmp_path)) == ["ckpt", "empty"]


def test_the_exchange_swaps_two_folders_in_one_step_where_the_system_can(tmp_path):
    first, second = fake_checkpoint(tmp_path / "a", step=1), fake_checkpoint(tmp_path / "b", step=2)
    if not swap.exchange(first, second):
        pytest.skip("this system has no atomic exchange of two paths; the two-rename fallback is used")
    assert step_of(first) == 2 and step_of(second) == 1


def crash_states(tmp_path):
    """Every state a kill can leave a replacement of step 2 by step 4 in, with the step load must find."""
    target = str(tmp_path / "ckpt")
    partial = files.partial_directory(target)
    yield "writing the new one", lambda: (fake_checkpoint(target, 2), fake_checkpoint(partial, 4, complete=False)), 2
    yield "before the exchange", lambda: (fake_checkpoint(target, 2), fake_checkpoint(partial, 4)), 2
    yield "after the exchange", lambda: (fake_checkpoint(target, 4), fake_checkpoint(partial, 2)), 4

    def half_removed():
        fake_checkpoint(target, 4)
        fake_checkpoint(partial, 2)
        os.remove(os.path.join(partial, files.META_FILE))
        os.remove(os.path.join(partial, "__0_0.distcp"))

    yield "removing the old one", half_removed, 4
    aside = files.aside_directory(partial)
    yield "between two renames", lambda: (fake_checkpoint(aside, 2), fake_checkpoint(partial, 4)), 4
    yield "first save, before its rename", lambda: fake_checkpoint(partial, 4), 4


@pytest.mark.parametrize("index", range(6))
def test_whichever_instant_a_replacement_was_cut_the_whole_checkpoint_is_found_and_the_next_save_tidies(
        tmp_path, index):
    what, lay_out, step = list(crash_states(tmp_path))[index]
    lay_out()
    target = str(tmp_path / "ckpt")
    found = target if files.is_complete(target) else files.recoverable(target)
    assert found is not None and step_of(found) == step, what
    files.tidy(target)  # what the next save does first
    assert os.listdir(tmp_path) == ["ckpt"] and step_of(target) == step, what


def test_tidying_removes_only_labkits_leftovers_of_that_name(tmp_path):
    target = fake_checkpoint(tmp_path / "ckpt")
    other = fake_checkpoint(files.partial_directory(str(tmp_path / "other")), complete=False)
    mine = tmp_path / ".partial-ckpt-0123abcd"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / ".partial-ckpt-not-hex").mkdir()
    fake_checkpoint(files.partial_directory(target), complete=False)
    files.tidy(target)
    assert sorted(os.listdir(tmp_path)) == sorted([".partial-ckpt-0123abcd", ".partial-ckpt-not-hex",
                                                   os.path.basename(other), "ckpt"])
    assert (mine / "notes.txt").exists()


# -- which of its checkpoints a run removes ---------------------------------------------------------------------


def periodic(path, step, model="mlp", written_by="checkpoint_every"):
    fake_checkpoint(path, step)
    with open(os.path.join(path, files.META_FILE), "w") as handle:
        json.dump({"step": step, "world_size": 2, "written_by": written_by,
                   "settings": {"model": model, "model_settings": {"dims": (4, 4)}}}, handle)


def test_a_run_removes_only_its_own_older_checkpoints_of_the_same_model(tmp_path):
    from labkit.rank.periodic_checkpoints import model_identity, prunable

    for step in (2, 4, 6, 8):
        periodic(str(tmp_path / f"step-{step:08d}"), step)
    periodic(str(tmp_path / "step-00000001"), 1, model="gpt")  # another model's
    periodic(str(tmp_path / "step-00000003"), 3, written_by=None)  # saved by hand under that name
    periodic(str(tmp_path / "step-00000012"), 12)  # newer than this run's step: another run's
    periodic(str(tmp_path / "step-1"), 1)  # not a name this logic writes
    fake_checkpoint(tmp_path / "step-00000000")
    (tmp_path / "step-00000000" / "notes.txt").write_text("mine")
    identity = model_identity({"model": "mlp", "model_settings": {"dims": (4, 4)}})
    assert prunable(str(tmp_path), 8, identity, keep=3) == ["step-00000002"]
    assert prunable(str(tmp_path), 8, identity, keep=1) == ["step-00000002", "step-00000004", "step-00000006"]
    assert prunable(str(tmp_path), 4, identity, keep=1) == ["step-00000002"]
