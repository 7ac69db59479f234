"""Backend and device planning, decided before any process starts."""

import pytest

from labkit.cluster.placement import DeviceError, plan_ranks
from labkit.wire.gpus import visible_gpus
from labkit.wire.rank_settings import RankSettings


def test_cpu_machine_defaults_to_gloo():
    plan = plan_ranks(4, gpus=(), cpu_count=2)
    assert plan.backend == "gloo" and plan.device_type == "cpu"
    assert plan.threads_per_rank == 1
    assert all(plan.launch_environment(rank, f"rank{rank}")["CUDA_VISIBLE_DEVICES"] == "" for rank in range(4))
    assert plan.controller_address == "127.0.0.1" and plan.interface is None  # loopback: one machine
    settings = plan.settings(2, 4, 2, 4, 0, 1, controller_ports={5, 6})
    assert settings["rank"] == 2 and settings["controller_ports"] == [5, 6] and settings["threads"] == 1


def test_a_rank_is_told_every_setting_it_reads():
    plan = plan_ranks(2, gpus=(), cpu_count=2, check_collectives=True)
    settings = plan.settings(1, 3, 1, 2, 0, 2, controller_ports=[7, 3])
    # The rank reads every key (rank.runtime): the notebook sends them all, whatever the plan.
    assert set(settings) == RankSettings.__required_keys__ == set(RankSettings.__annotations__)
    assert settings == {"rank": 1, "world_size": 3, "backend": "gloo", "threads": 1, "check_collectives": True,
                        "controller_address": "127.0.0.1", "interface": None, "controller_ports": [3, 7],
                        "local_rank": 1, "local_world_size": 2, "host_index": 0, "host_count": 2}


def test_gpus_default_to_nccl_one_rank_per_gpu():
    plan = plan_ranks(2, gpus=("0", "1", "2"))
    assert plan.backend == "nccl" and plan.device_type == "cuda"
    # every rank sees the lab's GPUs and takes its LOCAL_RANK-th, as under torchrun
    assert [plan.launch_environment(rank, "x")["CUDA_VISIBLE_DEVICES"] for rank in range(2)] == ["0,1", "0,1"]


def test_gloo_can_be_chosen_on_a_gpu_machine():
    plan = plan_ranks(4, backend="gloo", gpus=("0",))
    assert plan.backend == "gloo"


def test_nccl_without_gpus_is_refused():
    with pytest.raises(DeviceError, match="nccl needs GPUs.*backend='gloo'"):
        plan_ranks(2, backend="nccl", gpus=())


def test_more_nccl_ranks_than_gpus_is_refused():
    with pytest.raises(DeviceError, match="4 ranks asked, 2 GPUs visible .*at most 2 ranks, or use backend='gloo'"):
        plan_ranks(4, backend="nccl", gpus=("0", "1"))


def test_refusal_with_one_gpu_says_rank_not_ranks():
    with pytest.raises(DeviceError) as refused:
        plan_ranks(4, backend="nccl", gpus=("0",))
    message = str(refused.value)
    assert "4 ranks asked, 1 GPU visible (0)" in message
    assert "ask for at most 1 rank, or use backend='gloo'" in message


@pytest.mark.parametrize("ranks", [-1, 2.5, "4", True])
def test_rank_count_must_be_a_whole_number(ranks):
    with pytest.raises(DeviceError, match="whole number >= 0"):
        plan_ranks(ranks, gpus=())


def test_no_ranks_here_is_only_for_a_lab_that_others_can_join():
    with pytest.raises(DeviceError, match="at least 1: a lab of 0 ranks here is only for engines that join"):
        plan_ranks(0, gpus=(), cpu_count=2)


def test_unknown_backend_and_bad_threads():
    with pytest.raises(DeviceError, match="unknown backend 'mpi'"):
        plan_ranks(2, backend="mpi", gpus=())
    with pytest.raises(DeviceError, match="threads_per_rank"):
        plan_ranks(2, gpus=(), threads_per_rank=0)


def test_visible_gpus_honours_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ("3", "5")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == ()
