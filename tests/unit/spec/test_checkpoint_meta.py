"""A checkpoint's labkit.json, its checksums and the quick look that lists checkpoints to load instead: files only.

The folders are laid out by hand with the names a real checkpoint holds, so each
edit a person could make to one is tried without a process.
"""

import json
import os

import pytest

from labkit.runs.checkpoint_check import check_files, check_sums, others_beside, read_meta, what_to_do
from labkit.runs.checkpoints import carried_settings
from labkit.spec import checkpoint_sums as sums
from labkit.spec.checkpoint_meta import looks_whole, meta_problem
from labkit.spec.errors import LabConfigError

FILES = (".metadata", "__0_0.distcp", "__1_0.distcp", "random-state-rank0.pt", "random-state-rank1.pt")


def sound_meta(**changes):
    meta = {"settings": {"strategy": "ddp", "model": "mlp"}, "step": 4, "world_size": 2, "mesh": {"dp": 2}}
    meta.update(changes)
    return meta


def saved_checkpoint(path, **changes):
    """A folder as a save leaves it: every file, and labkit.json listing them with their checksums."""
    os.makedirs(path)
    for name in FILES:
        (path / name).write_bytes(name.encode() * 100)
    meta = sound_meta(files=sums.records(str(path), list(FILES)), **changes)
    (path / "labkit.json").write_text(json.dumps(meta))
    return str(path)


# -- every field a load reads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, said", [
    ({"step": -5}, "has step -5, which no save writes (the step is a whole number, 0 or more"),
    ({"step": "4"}, "has step '4', which no save writes"),
    ({"step": 4.0}, "has step 4.0"),
    ({"step": True}, "has step True"),
    ({"world_size": 0}, "has world_size 0, which no save writes (the number of ranks that saved it"),
    ({"world_size": "2"}, "has world_size '2'"),
    ({"world_size": 10 ** 9}, "has world_size 1000000000"),
    ({"settings": ["ddp"]}, "has settings ['ddp'], which no save writes"),
    ({"settings": {"model": "mlp"}}, "has settings without a strategy"),
    ({"settings": {"strategy": 3}}, "has strategy 3, which no save writes"),
    ({"settings": {"strategy": "ddp", "model": None}}, "has model None"),
    ({"mesh": {"dp": 4}}, "has mesh {'dp': 4} for world_size 2"),
    ({"mesh": {"dp": -2}}, "has mesh {'dp': -2}, which no save writes"),
    ({"files": {"../../etc/passwd": {"rank": 0, "bytes": 1, "sha256": "0" * 64}}}, "has the files entry"),
    ({"files": {"__0_0.distcp": {"rank": 0, "bytes": 1, "sha256": "abc"}}}, "has the files entry '__0_0.distcp'"),
])
def test_each_field_no_save_writes_is_named_with_its_value(change, said):
    problem = meta_problem(sound_meta(**change))
    assert problem is not None and said in problem and "\n" not in problem


def test_a_missing_field_and_a_record_that_is_no_object_are_named():
    assert meta_problem([1, 2]) == "holds a list, not the checkpoint's record (a JSON object)"
    meta = sound_meta()
    del meta["step"]
    assert meta_problem(meta) == "lacks step, which a load needs"


def test_a_sound_record_passes_and_a_long_value_is_cut_short():
    assert meta_problem(sound_meta()) is None
    assert meta_problem(sound_meta(mesh=None)) is None  # saved before meshes were recorded
    problem = meta_problem(sound_meta(step="x" * 500))
    assert problem is not None and len(problem) < 160 and "..." in problem


def test_a_world_size_edited_against_the_files_saved_is_named(tmp_path):
    path = saved_checkpoint(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "labkit.json").read_text())
    meta.update(world_size=4, mesh={"dp": 4})
    assert meta_problem(meta) == ("has world_size 4, but the files it lists hold the random states of 2 ranks: "
                                  "one of the two was changed")
    (tmp_path / "ckpt" / "labkit.json").write_text(json.dumps(meta))
    with pytest.raises(LabConfigError, match=r"ckpt/labkit.json has world_size 4, but .*nothing was loaded"):
        read_meta(path)


# -- the checksums ------------------------------------------------------------------------------------------------


def test_each_file_is_recorded_with_the_rank_that_wrote_it_and_checked_by_a_loading_rank(tmp_path):
    path = saved_checkpoint(tmp_path / "ckpt")
    meta = read_meta(path)
    assert {name: record["rank"] for name, record in meta["files"].items()} == {
        ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1, "random-state-rank0.pt": 0, "random-state-rank1.pt": 1}
    assert sums.shares(meta["files"], 1) == {0: meta["files"]}  # one loading rank checks all
    assert sorted(sums.shares(meta["files"], 2)[1]) == ["__1_0.distcp", "random-state-rank1.pt"]
    assert sorted(sums.own_records(path, 1)) == ["__1_0.distcp", "random-state-rank1.pt"]
    assert sums.unrecorded(path, meta["files"]) == {}
    assert all(sums.mismatches(path, share) == [] for share in sums.shares(meta["files"], 2).values())


def test_flipped_bytes_of_the_same_size_are_named_with_the_rank_that_wrote_the_file(tmp_path):
    path = saved_checkpoint(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - byte for byte in data[middle:middle + 64])
    shard.write_bytes(bytes(data))
    meta = read_meta(path)
    check_files(path, meta)  # the size is the same: only the checksum tells
    given = []

    def on_ranks(shares):
        given.append(shares)
        return [sums.mismatches(path, share) for share in shares.values()]

    with pytest.raises(LabConfigError, match=r"ckpt/__1_0.distcp \(written by rank 1\) does not match its checksum "
                                             r"\(sha256 .*: its bytes changed since the save: the checkpoint .* is "
                                             r"damaged, so nothing was loaded"):
        check_sums(path, meta, 2, on_ranks)
    assert sorted(given[0]) == [0, 1]


def test_a_file_of_another_size_is_refused_before_any_rank_hashes(tmp_path):
    path = saved_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "random-state-rank1.pt").write_bytes(b"short")
    with pytest.raises(LabConfigError, match=r"random-state-rank1.pt is cut short \(5 of 2100 bytes, written by "
                                             r"rank 1\)"):
        check_files(path, read_meta(path))


def test_a_checkpoint_saved_before_checksums_loads_with_one_note(tmp_path, capsys):
    path = saved_checkpoint(tmp_path / "ckpt")
    meta = read_meta(path)
    del meta["files"]
    check_sums(path, meta, 2, lambda shares: pytest.fail("nothing to hash"))
    assert capsys.readouterr().out.count("saved without checksums") == 1


# -- which checkpoints a refusal suggests ------------------------------------------------------------------------


def test_only_checkpoints_that_look_whole_are_suggested_instead(tmp_path):
    saved_checkpoint(tmp_path / "main")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "labkit.json").write_bytes(b"\xff\xfe not json")
    (tmp_path / "emptyjson").mkdir()
    (tmp_path / "emptyjson" / "labkit.json").write_text("{}")
    saved_checkpoint(tmp_path / "broken")
    (tmp_path / "broken" / "__1_0.distcp").unlink()
    saved_checkpoint(tmp_path / "minus", step=-5)
    saved_checkpoint(tmp_path / "shorter")
    (tmp_path / "shorter" / "__0_0.distcp").write_bytes(b"x")
    damaged = saved_checkpoint(tmp_path / "damaged")
    assert others_beside(damaged) == ["main"]
    assert what_to_do(damaged).endswith(f"e.g. {tmp_path / 'main'} (beside it, these look whole by their "
                                        "labkit.json and file sizes: main)")
    assert not looks_whole(str(tmp_path / "garbage")) and looks_whole(str(tmp_path / "main"))


def test_a_checkpoint_saved_before_checksums_looks_whole_with_its_metadata_and_random_states(tmp_path):
    path = saved_checkpoint(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "labkit.json").read_text())
    del meta["files"]
    (tmp_path / "old" / "labkit.json").write_text(json.dumps(meta))
    assert looks_whole(path)
    (tmp_path / "old" / "random-state-rank1.pt").unlink()
    assert not looks_whole(path)


# -- settings a load carries to another strategy --------------------------------------------------------------------


def test_micro_batches_default_under_the_strategy_loaded_into():
    saved = {"strategy": "fsdp", "model": "gpt", "micro_batches": 1, "reshard_after_forward": True, "lr": 0.01}
    assert carried_settings(saved, {}) == saved
    assert carried_settings(saved, {"strategy": "fsdp"}) == saved
    assert carried_settings(saved, {"strategy": "pp"}) == {"strategy": "fsdp", "model": "gpt", "lr": 0.01}
