"""Which GPU each rank gets, checked over the whole world before any rank is told its place; no processes.

A rank's GPU is its number among the ranks on its host (``wire.gpus.gpu_index``), so a rank that
joins or replaces another is checked together with every rank already there, whoever launched it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from labkit.cluster import engines
from labkit.cluster.engines import JOINED, RankRecord, assign
from labkit.cluster.placement import DeviceError, RankPlan, check_host_places
from labkit.rank.context import script_gpu
from labkit.wire.gpus import gpu_index, gpus_shown


class FakeEngine:
    """An engine that becomes a rank at once: what it was told is kept for the test to read."""

    def __init__(self, told: dict, engine: int) -> None:
        self.told, self.engine = told, engine

    def apply_async(self, function, settings):
        self.told[self.engine] = settings
        return SimpleNamespace(get=lambda timeout: None)


def lab_of(records: dict[int, RankRecord], on_this_machine: bool, backend: str = "nccl",
           ranks_per_host: int | None = None):
    """A stand-in for the cluster ``assign`` works on: its records, plan, launcher and engines."""
    plan = RankPlan(backend=backend, ranks=len(records), threads_per_rank=1, ranks_per_host=ranks_per_host,
                    on_this_machine=on_this_machine)
    told: dict[int, dict] = {}
    return SimpleNamespace(records=dict(records), plan=plan, told=told,
                           launcher=SimpleNamespace(on_this_machine=on_this_machine),
                           engine_connection=lambda: {"registration": 5000},
                           client={engine: FakeEngine(told, engine) for engine in range(100)})


def record(engine: int, host: str, gpus: int, slot: str = JOINED) -> RankRecord:
    return RankRecord(engine, 1000 + engine, host, slot, None if slot == JOINED else slot, gpus)


def joiner(engine: int, host: str, gpus: int) -> tuple[int, dict]:
    return engine, {"pid": 1000 + engine, "host": host, "slot": JOINED, "gpus": gpus}


def hosted(engine: int, rank: int, host: str, gpus: int) -> tuple[int, dict]:
    return engine, {"pid": 1000 + engine, "host": host, "slot": f"rank{rank}", "gpus": gpus}


@pytest.mark.parametrize("on_this_machine", [True, False])
def test_engines_joining_on_another_host_are_numbered_among_every_rank_there(on_this_machine):
    # Two ranks already on host b (2 GPUs); a third joining there would be its rank 2, cuda:2.
    lab = lab_of({0: record(0, "a", 2, "rank0"), 1: record(1, "b", 2), 2: record(2, "b", 2)}, on_this_machine)
    with pytest.raises(DeviceError, match=r"host b shows 2 GPUs and 3 ranks would be placed there "
                                          r"\(ranks 1, 2, 3\): nccl runs one rank per GPU. Start at most 2 ranks"):
        assign(lab, [joiner(7, "b", 2)], [3], deadline=0)
    assert sorted(lab.records) == [0, 1, 2] and lab.told == {}  # refused before anything was recorded or told
    # On host c, with its own GPUs, the same engine is rank 0 there: cuda:0.
    settings = assign(lab, [joiner(7, "c", 2)], [3], deadline=0)
    assert settings[3]["local_rank"] == 0 and settings[3]["host_index"] == 2 and lab.records[3].gpus == 2


def test_a_heal_that_places_a_new_rank_on_a_full_host_is_refused():
    # Host b's 2 GPUs are taken by ranks 1 and 2; rank 0 (host a) is replaced by an engine that came up on b.
    lab = lab_of({1: record(1, "b", 2), 2: record(2, "b", 2)}, on_this_machine=False)
    with pytest.raises(DeviceError, match=r"host b shows 2 GPUs and 3 ranks would be placed there \(ranks 0, 1, 2\)"):
        assign(lab, [joiner(9, "b", 2)], [0], deadline=0)
    assert sorted(lab.records) == [1, 2]
    assign(lab, [joiner(9, "a", 1)], [0], deadline=0)  # back on host a it fits
    assert sorted(lab.records) == [0, 1, 2]


@pytest.mark.parametrize("on_this_machine", [True, False])
def test_a_host_of_one_gpu_holds_one_rank(on_this_machine):
    lab = lab_of({}, on_this_machine)
    with pytest.raises(DeviceError, match=r"host solo shows 1 GPU and 2 ranks would be placed there \(ranks 0, 1\)"):
        assign(lab, [joiner(1, "solo", 1), joiner(2, "solo", 1)], [0, 1], deadline=0)
    with pytest.raises(DeviceError, match="host bare shows 0 GPUs and 1 rank"):
        check_host_places("nccl", ["bare"], [0], ranks_per_host=None)


def test_the_hosted_launcher_is_checked_too_once_engines_join_its_host():
    # The lab's own launcher started ranks 0 and 1 on this machine's 2 GPUs; a join from here takes a third.
    lab = lab_of({0: record(0, "here", 2, "rank0"), 1: record(1, "here", 2, "rank1")}, on_this_machine=True)
    with pytest.raises(DeviceError, match="host here shows 2 GPUs and 3 ranks"):
        assign(lab, [joiner(5, "here", 2)], [2], deadline=0)
    # Its own ranks, replaced in place, still fit.
    lab.records.pop(1)
    settings = assign(lab, [hosted(6, 1, "here", 2)], [1], deadline=0)
    assert settings[1]["local_rank"] == 1 and lab.told[6]["rank"] == 1


def test_a_rank_past_the_gpus_its_own_process_sees_is_refused():
    # Host h shows 4 GPUs to rank 0, but rank 2 was narrowed to 2 (CUDA_VISIBLE_DEVICES=0,1): cuda:2 is not there.
    with pytest.raises(DeviceError, match=r"rank 2 would be rank 2 on host h and use cuda:2, but its process "
                                          r"sees 2 GPUs \(host h shows 4 GPUs, 3 ranks placed there\)"):
        check_host_places("nccl", ["h", "h", "h"], [4, 4, 2], ranks_per_host=None)
    check_host_places("nccl", ["h", "h", "h"], [4, 4, 4], ranks_per_host=None)


def test_gloo_ranks_need_no_gpu_but_ranks_per_host_still_holds():
    check_host_places("gloo", ["a", "a", "a"], [0, 0, 0], ranks_per_host=None)
    lab = lab_of({0: record(0, "a", 0)}, on_this_machine=False, backend="gloo", ranks_per_host=1)
    with pytest.raises(DeviceError, match=r"host a has 2 ranks \(ranks 0, 1\), ranks_per_host is 1"):
        assign(lab, [joiner(1, "a", 0)], [1], deadline=0)


@pytest.mark.parametrize("environ, expected", [
    ({"LOCAL_RANK": "3"}, 3),  # the host's GPUs, unnarrowed: the LOCAL_RANK-th, as torchrun
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 3),
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "6"}, 0),  # a scheduler showing this process one GPU
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": " 2 , "}, 0),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0),  # no LOCAL_RANK: a single process
])
def test_a_script_under_torchrun_picks_its_gpu_by_the_ranks_rule(environ, expected):
    assert script_gpu(environ) == expected
    assert script_gpu(environ) == gpu_index(int(environ.get("LOCAL_RANK", "0")), gpus_shown(environ))


def test_the_rule_itself():
    assert gpus_shown({}) is None and gpus_shown({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpus_shown({"CUDA_VISIBLE_DEVICES": "0,1,-1"}) == 2
    assert [gpu_index(local, None) for local in range(3)] == [0, 1, 2]
    assert gpu_index(5, 1) == 0 and gpu_index(5, 8) == 5
    assert engines.RankRecord(1, 2, "h", JOINED, None).gpus == 0  # a record made without a count


# Engines that name the GPUs they see (``entry.describe_engine``): each rank is checked by the GPU it will use.

def named(engine: int, host: str, *gpu_ids: str) -> tuple[int, dict]:
    return engine, {"pid": 1000 + engine, "host": host, "slot": JOINED, "gpus": len(gpu_ids),
                    "gpu_ids": list(gpu_ids)}


@pytest.mark.parametrize("spelling", [str, lambda index: f"GPU-{index}aa0-uuid"])
def test_engines_shown_each_their_own_gpu_share_a_host(spelling):
    # One GPU per process (Slurm --gpus-per-task=1): every engine sees one GPU, each a different one.
    lab = lab_of({}, on_this_machine=False)
    settings = assign(lab, [named(engine, "node", spelling(engine)) for engine in range(4)], [0, 1, 2, 3],
                      deadline=0)
    assert [settings[rank]["local_rank"] for rank in range(4)] == [0, 1, 2, 3]
    assert [lab.records[rank].gpu_ids for rank in range(4)] == [(spelling(rank),) for rank in range(4)]
    assert [gpu_index(settings[rank]["local_rank"], 1) for rank in range(4)] == [0, 0, 0, 0]


def test_two_ranks_shown_the_same_gpu_are_refused():
    lab = lab_of({0: record(0, "node", 1, "rank0")}, on_this_machine=False)
    lab.records[0].gpu_ids = ("0",)
    with pytest.raises(DeviceError, match=r"ranks 1 and 2 on host node would both use GPU 2 \(rank 1 as its "
                                          r"cuda:0, rank 2 as its cuda:0\): nccl runs one rank per GPU"):
        assign(lab, [named(1, "node", "2"), named(2, "node", "2")], [1, 2], deadline=0)
    assert sorted(lab.records) == [0] and lab.told == {}
    assign(lab, [named(1, "node", "2"), named(2, "node", "3")], [1, 2], deadline=0)


def test_engines_shown_the_same_list_take_its_gpus_in_turn():
    check_host_places("nccl", ["h", "h"], [2, 2], None, [("0", "1"), ("0", "1")])
    with pytest.raises(DeviceError, match=r"rank 2 would be rank 2 on host h and use cuda:2, but its process "
                                          r"sees 2 GPUs \(0, 1\) \(host h holds 3 ranks\)"):
        check_host_places("nccl", ["h", "h", "h"], [2, 2, 2], None, [("0", "1")] * 3)
    # Ranks on another host are numbered there: the same list fits them.
    check_host_places("nccl", ["h", "h", "g"], [2, 2, 2], None, [("0", "1")] * 3)


def test_lists_that_overlap_are_refused_where_counts_alone_saw_none():
    # Rank 0 sees GPUs 2 and 3 and takes the first; rank 1, shown GPU 2 alone, would take it again.
    hosts, counts, ids = ["h"] * 2, [2, 1], [("2", "3"), ("2",)]
    check_host_places("nccl", hosts, counts, None)  # the count rule lets it through
    with pytest.raises(DeviceError, match=r"ranks 0 and 1 on host h would both use GPU 2 \(rank 0 as its cuda:0, "
                                          r"rank 1 as its cuda:0\)"):
        check_host_places("nccl", hosts, counts, None, ids)


def test_a_process_shown_no_gpu_is_refused_by_name_too():
    with pytest.raises(DeviceError, match=r"rank 0 would be rank 0 on host bare and use cuda:0, but its process "
                                          r"sees 0 GPUs \(host bare holds 1 rank\)"):
        check_host_places("nccl", ["bare"], [0], None, [()])


def test_gpus_spelled_differently_are_not_compared():
    # "1" and a UUID may be the same GPU, which only the driver knows: they are taken as two (see placement).
    check_host_places("nccl", ["h", "h"], [1, 1], None, [("1",), ("GPU-5e1c0de0",)])


def test_an_engine_that_does_not_name_its_gpus_holds_its_host_to_the_count_rule():
    # Rank 1's engine is of an older labkit: host node is checked by count, which cannot tell
    # engines shown each their own GPU from engines sharing one, and so refuses both.
    lab = lab_of({0: record(0, "node", 1, "rank0")}, on_this_machine=False)
    lab.records[0].gpu_ids = ("0",)
    with pytest.raises(DeviceError, match=r"host node shows 1 GPU and 2 ranks would be placed there"):
        assign(lab, [joiner(1, "node", 1)], [1], deadline=0)
    # ... and ranks that named their GPUs are still checked by them beside it.
    with pytest.raises(DeviceError, match="ranks 0 and 2 on host node would both use GPU 0"):
        check_host_places("nccl", ["node"] * 3, [4, 4, 4], None, [("0", "1", "2", "3"), None, ("0",)])
    assign(lab, [joiner(1, "other", 1)], [1], deadline=0)
    assert lab.records[1].gpu_ids is None


@pytest.mark.parametrize("listed, expected", [("GPU-aa,GPU-bb", ["GPU-aa", "GPU-bb"]), ("3", ["3"]), ("", [])])
def test_an_engine_names_the_gpus_cuda_visible_devices_shows_it(monkeypatch, listed, expected):
    import IPython

    from labkit.wire import entry

    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace(user_ns={}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    description = entry.describe_engine()
    assert description["gpu_ids"] == expected and description["gpus"] == len(expected)
