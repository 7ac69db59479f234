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


def test_engines_count_what_ipyparallel_starts_and_refuse_what_it_would_misread():
    import pytest

    from labkit.cluster.launchers import engines_room
    from labkit.spec.errors import LabConfigError

    assert engines_room({"node1": 2, "node2": {"n": 3, "remote_python": "/opt/py"}, "node3": {}}) == 6
    for bad in ({"node1": 0}, {"node1": "two"}, {"node1": True}, {"": 2}, {"node1": {"n": -1}}, ["node1"]):
        with pytest.raises(LabConfigError, match="engines"):
            engines_room(bad)


def test_an_ssh_lab_with_no_room_for_its_ranks_is_refused_before_anything_starts():
    import shutil

    import pytest

    if shutil.which("ssh") is None:
        pytest.skip("no ssh client here: a lab refuses the ssh launcher for that first (apt-get install openssh-client)")

    from labkit import Lab
    from labkit.spec.errors import LabConfigError

    with pytest.raises(LabConfigError, match=r"\(0 engine\(s\) there now\), and ranks=4 needs 4"):
        Lab(ranks=4, launcher="ssh")  # the defaults alone: ipyparallel's engines={} would start none
    with pytest.raises(LabConfigError, match=r"\(3 engine\(s\) there now\), and ranks=4"):
        Lab(ranks=4, launcher="ssh", engines={"node1": 2, "node2": 1})
    assert Lab(ranks=3, launcher="ssh", engines={"node1": 2, "node2": 1}).plan.ranks == 3  # checked, not started


def test_one_engine_of_a_set_is_signalled_through_its_own_launcher_by_pid_and_host():
    from types import SimpleNamespace

    from labkit.cluster.launchers import signal_one_engine

    got = []

    def engine(host, pid):
        return SimpleNamespace(hostname=host, pid=pid, signal=lambda signum: got.append((host, pid, signum)))

    def gone(signum):
        raise ProcessLookupError  # what an engine that ended already answers

    engines = SimpleNamespace(launchers={"node1/0": engine("node1", 10), "node2/0": engine("node2", 10),
                                         "node2/1": engine("node2", 11),
                                         "node2/2": SimpleNamespace(hostname="node2", pid=12, signal=gone)})
    def rank(pid, launched_on):
        return SimpleNamespace(pid=pid, host="lab-node2", launched_on=launched_on)

    signal_one_engine(engines, rank(10, "me@node2:2222"), 9)
    assert got == [("node2", 10, 9)]  # the same pid on another host is another process
    signal_one_engine(engines, rank(12, "node2"), 9)  # ended already: nothing raised
    signal_one_engine(SimpleNamespace(), rank(10, "node2"), 9)  # a set launcher without engines of its own
    signal_one_engine(engines, rank(11, None), 9)  # no host entry (not started by ssh): nothing is sent
    assert got == [("node2", 10, 9)]
    # A set that signals one task itself (Slurm's: a job step on the rank's node) gets the pid and host name.
    tasks = []
    slurm_set = SimpleNamespace(signal_task=lambda pid, node, signum: tasks.append((pid, node, signum)))
    signal_one_engine(slurm_set, rank(13, None), 9)
    assert tasks == [(13, "lab-node2", 9)]


def _refused_port() -> int:
    """A local port nothing listens on (bound, then closed): a connection there is refused at once."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_host_ssh_cannot_reach_is_named_with_what_ssh_said_and_its_ranks_are_dropped_not_replaced():
    import shutil
    from types import SimpleNamespace

    import pytest

    from labkit.cluster.engines import RankRecord
    from labkit.cluster.launchers import choose_launcher
    from labkit.cluster.ssh_reach import ssh_reach_note, unreachable_ranks
    from labkit.runs.recovery import dropped_notes

    if shutil.which("ssh") is None:
        pytest.skip("ssh is not installed: apt-get install openssh-client")
    cut = f"127.0.0.1:{_refused_port()}"
    choice = choose_launcher("ssh", engines={cut: 2}, ssh_args=["-o", "StrictHostKeyChecking=no"])
    assert ssh_reach_note(choice).startswith(f"; ssh cannot reach {cut} (") and "refused" in ssh_reach_note(choice)
    assert ssh_reach_note(choose_launcher("mpi")) == ""  # another launcher names no hosts
    from labkit.cluster.site_cluster import SITE_LAUNCHER

    assert unreachable_ranks(SimpleNamespace(records={0: SimpleNamespace(launched_on="x")}, launcher=SITE_LAUNCHER),
                             [0]) == {}  # a site's ranks: no launcher class, nothing to probe

    records = {rank: RankRecord(engine=rank, pid=100 + rank, host="far", slot="set:ranks1", engine_set="ranks1",
                                launched_on=cut if rank >= 2 else None) for rank in range(4)}
    cluster = SimpleNamespace(records=records, launcher=choice)
    found = unreachable_ranks(cluster, [1, 2, 3])
    assert sorted(found) == [2, 3] and found[2].startswith(f"its host {cut} cannot be reached over ssh (")
    assert records[2].launched_on is None  # no signal is sent there through ssh any more
    notes = dropped_notes([0, 2, 3], found)
    assert notes[0] == "dropped rank 0, which joined from another machine and cannot be restarted from here"
    assert notes[1].startswith(f"dropped ranks 2, 3: its host {cut} cannot be reached over ssh")
    assert notes[1].endswith("so nothing can be started again there; the ranks after them were renumbered")
