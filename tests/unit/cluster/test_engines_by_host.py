"""The ssh launcher's ``engines`` as the lab passes it on: each host's engines told their host entry, and a
replaced rank sent back to the host it ran on (pure: no launcher is started)."""

from labkit.cluster.launchers import engines_by_host
from labkit.wire.entry import LAUNCHED_ON_VARIABLE

SET = {"LABKIT_SLOT": "set:ranks1"}


def test_every_host_keeps_its_count_and_its_engines_know_their_host():
    chosen = engines_by_host({"node1": 2, "node2": 3}, SET)
    assert chosen == {
        "node1": {"n": 2, "environment": {"LABKIT_SLOT": "set:ranks1", LAUNCHED_ON_VARIABLE: "node1"}},
        "node2": {"n": 3, "environment": {"LABKIT_SLOT": "set:ranks1", LAUNCHED_ON_VARIABLE: "node2"}},
    }


def test_a_hosts_own_options_and_environment_are_kept_beside_the_sets():
    engines = {"me@node1:2222": {"n": 2, "remote_python": "/opt/py", "environment": {"OMP_NUM_THREADS": "4"}}}
    chosen = engines_by_host(engines, SET)
    assert chosen["me@node1:2222"] == {"n": 2, "remote_python": "/opt/py", "environment": {
        "LABKIT_SLOT": "set:ranks1", "OMP_NUM_THREADS": "4", LAUNCHED_ON_VARIABLE: "me@node1:2222"}}
    assert engines["me@node1:2222"] == {"n": 2, "remote_python": "/opt/py", "environment": {"OMP_NUM_THREADS": "4"}}


def test_a_replacement_is_one_engine_on_the_host_its_rank_ran_on():
    chosen = engines_by_host({"node1": 2, "node2": {"n": 2, "remote_python": "/opt/py"}}, SET, only="node2")
    assert chosen == {"node2": {"n": 1, "remote_python": "/opt/py",
                                "environment": {"LABKIT_SLOT": "set:ranks1", LAUNCHED_ON_VARIABLE: "node2"}}}


def test_a_replacement_whose_host_is_gone_from_the_list_goes_where_ipyparallel_would_put_one_engine():
    chosen = engines_by_host({"node1": 2, "node2": 2}, SET, only="node9")
    assert list(chosen) == ["node1", "node2"] and chosen["node1"]["n"] == 2  # the launcher starts 1: on node1


def test_an_engine_sets_options_keep_the_users_beside_the_labs_and_place_a_replacement():
    from ipyparallel.cluster.launcher import find_launcher_class

    from labkit.cluster.launchers import LauncherChoice

    ssh = LauncherChoice("ssh", find_launcher_class("ssh", "engine"),
                         {"engines": {"node1": 2, "node2": 2}, "environment": {"A": "1"}, "engine_args": ["--x"]})
    started = ssh.set_options(SET, ["--lab"], "/tmp/log")
    assert started["environment"] == {"A": "1", **SET} and started["engine_args"] == ["--x", "--lab"]
    assert sorted(started["engines"]) == ["node1", "node2"]
    replaced = ssh.set_options(SET, ["--lab"], "/tmp/log", host="node2")
    assert replaced["engines"] == {"node2": {"n": 1, "environment": {"A": "1", **SET, LAUNCHED_ON_VARIABLE: "node2"}}}
    mpi = LauncherChoice("mpi", find_launcher_class("mpi", "engine"), {})
    assert "engines" not in mpi.set_options(SET, [], "/tmp/log", host="node2")  # no hosts named: nothing to place
