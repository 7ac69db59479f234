"""Placing a lab on a network, without processes: addresses, interfaces, host layout, launchers, join tokens."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from labkit.cluster.join import decode_token, encode_token
from labkit.cluster.launchers import choose_launcher
from labkit.cluster.placement import DeviceError, check_host_places, host_layout, plan_ranks
from labkit.magics.network import add_network_arguments, launcher_option, network_settings
from labkit.spec.errors import LabConfigError
from labkit.spec.network import (NetworkError, address_of, check_ipv4, interface_of, ipv4_addresses,
                                 place_on_network, source_address)


def test_a_lab_on_loopback_places_every_rank_on_loopback():
    interface, address = place_on_network("127.0.0.1")
    assert address == "127.0.0.1" and interface in ipv4_addresses()


def test_an_interface_given_wins_and_a_missing_one_lists_what_there_is():
    loopback = interface_of("127.0.0.1")
    assert place_on_network("127.0.0.1", loopback) == (loopback, address_of(loopback))
    with pytest.raises(NetworkError, match=r"no IPv4 interface 'eth99' \(it has: .*127\.0\.0\.1"):
        address_of("eth99")


@pytest.mark.parametrize("text", ["nowhere", "300.1.1.1", "", 17, None])
def test_an_address_must_be_ipv4(text):
    with pytest.raises(NetworkError, match="is an IPv4 address"):
        check_ipv4(text, "controller_address")


def test_an_address_not_on_this_machine_is_refused_with_the_ones_it_has():
    with pytest.raises(NetworkError, match="203.0.113.7 is not an address of this machine"):
        interface_of("203.0.113.7")


def test_the_source_address_towards_loopback_is_loopback():
    assert source_address("127.0.0.5") == "127.0.0.1"


def test_a_plan_refuses_a_controller_address_this_machine_does_not_have():
    with pytest.raises(LabConfigError, match="not an address of this machine"):
        plan_ranks(2, gpus=(), cpu_count=2, controller_address="203.0.113.7")


def test_ranks_elsewhere_are_not_bounded_by_this_machine():
    plan = plan_ranks(64, backend="nccl", gpus=(), cpu_count=2, available_memory=10**9, on_this_machine=False)
    assert plan.ranks == 64 and plan.threads_per_rank is None  # each host decides its threads
    assert plan.settings(5, 64, 1, 8, 0, 8)["threads"] >= 1


def test_host_layout_numbers_ranks_as_torchrun_does():
    assert host_layout(["a", "a", "b", "c", "b"]) == [(0, 2, 0, 3), (1, 2, 0, 3), (0, 2, 1, 3), (0, 1, 2, 3),
                                                      (1, 2, 1, 3)]
    assert host_layout(["only"]) == [(0, 1, 0, 1)]


def test_nccl_placement_is_refused_past_a_hosts_gpus_or_ranks_per_host():
    check_host_places("nccl", ["a", "a", "b"], [2, 2, 1], ranks_per_host=2)
    with pytest.raises(DeviceError, match="host b shows 1 GPU and 2 ranks would be placed there"):
        check_host_places("nccl", ["a", "b", "b"], [1, 1, 1], ranks_per_host=None)
    with pytest.raises(DeviceError, match=r"host a has 3 ranks \(ranks 0, 1, 2\), ranks_per_host is 2"):
        check_host_places("gloo", ["a", "a", "a"], [0, 0, 0], ranks_per_host=2)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8"])
def test_ranks_per_host_must_be_a_positive_integer(value):
    with pytest.raises(DeviceError, match="ranks_per_host must be a positive integer"):
        plan_ranks(2, gpus=(), cpu_count=2, ranks_per_host=value)


def test_the_labs_own_launcher_is_registered_where_ipyparallel_finds_launchers():
    from ipyparallel.cluster.launcher import find_launcher_class

    from labkit.cluster.hosted.launchers import HostedEngineLauncher

    assert choose_launcher().engine_class is HostedEngineLauncher and choose_launcher().hosted
    try:
        assert find_launcher_class("hosted", "engine") is HostedEngineLauncher
    except KeyError:
        pytest.skip("labkit's package metadata is not installed here (run from a source tree)")


def test_launchers_are_checked_before_anything_starts():
    with pytest.raises(LabConfigError, match="unknown launcher 'mpich': choose one of .*hosted.*mpi.*slurm.*ssh"):
        choose_launcher("mpich")
    with pytest.raises(LabConfigError, match="has no option engine; its options are: .*engines"):
        choose_launcher("ssh", engine={"h": 1})
    with pytest.raises(LabConfigError, match="refused its options: .*expected a list"):
        choose_launcher("mpi", mpi_args=3, mpi_cmd=[sys.executable])
    with pytest.raises(LabConfigError, match="runs 'no-such-mpiexec', which is not on this machine's PATH"):
        choose_launcher("mpi", mpi_cmd=["no-such-mpiexec"])
    choice = choose_launcher("mpi", mpi_cmd=[sys.executable], mpi_args=["-x", "A"])
    assert choice.describe().startswith("mpi (mpi_args=['-x', 'A']") and not choice.on_this_machine
    assert choice.config()["MPIEngineSetLauncher"]["mpi_args"] == ["-x", "A"]


def test_a_batch_launcher_without_its_scheduler_says_so(monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    with pytest.raises(LabConfigError, match="the slurm launcher runs 'sbatch'.*install the batch system"):
        choose_launcher("slurm")


def test_a_join_token_round_trips_and_a_mangled_one_is_refused():
    connection = {"registration": 4242, "interface": "tcp://10.0.0.5", "key": "k", "curve_serverkey": None}
    assert decode_token(encode_token(connection)) == connection
    with pytest.raises(LabConfigError, match="not a lab's join token"):
        decode_token("!!!not-base64!!!")
    with pytest.raises(LabConfigError, match="no controller address"):
        decode_token(encode_token({"key": "k"}))


def test_start_options_for_other_machines_parse_into_lab_arguments():
    parser = argparse.ArgumentParser()
    add_network_arguments(parser)
    options = parser.parse_args(["--launcher", "mpi", "--launcher-option", 'mpi_args=["-n", "2"]',
                                 "--launcher-option", "stop_timeout=5", "--controller-address", "10.0.0.5",
                                 "--encrypt"])
    assert network_settings(options) == {"launcher": "mpi", "mpi_args": ["-n", "2"], "stop_timeout": 5,
                                         "controller_address": "10.0.0.5", "encrypt": True}
    assert network_settings(parser.parse_args([])) == {"launcher": "hosted"}
    assert launcher_option("engine_cmd=ipengine") == ("engine_cmd", "ipengine")  # not a literal: text
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        launcher_option("mpi_args")
