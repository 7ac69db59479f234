"""The lab's ranks started through ipyparallel's SSH launcher, for real: OpenSSH servers on namespace hosts.

``NetnsHosts(count=3)``: the notebook's side (``multihost_driver.py``) runs in host 0 with the controller on
its address; hosts 1 and 2 run Debian's sshd (``tests/netns_ssh.py``: a key pair the test makes, nothing else
accepted, a host name of their own). ``Lab(ranks=4, launcher="ssh", engines={host1: 2, host2: 2})`` starts
the engines over ssh; DDP across the hosts verifies equal to one process; a rank killed on host 2 is
replaced through ssh on host 2, one frozen on host 1 is killed and replaced there; host 2 cut off the
network is named and its ranks dropped (the lab goes on with host 1's); and after ``stop()`` (host 2 back)
nothing of the lab runs on either host.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.lab.test_launchers import wait_for
from tests.multihost_driver import DriverClient
from tests.netns_hosts import NetnsHosts
from tests.netns_ssh import SshHosts, ssh_unavailable

UNAVAILABLE = ssh_unavailable()
pytestmark = [pytest.mark.lab, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"ssh hosts: {UNAVAILABLE}")]

RANKS_OF = "result = [(r, c.host, c.pid, c.launched_on) for r, c in sorted(lab.cluster.records.items())]"
# In the driver: wait (30 s at most) until the lab names rank {rank} broken, then heal; what it said of both.
NAMED_THEN_HEALED = """
import time
deadline = time.monotonic() + 30
while {rank} not in lab.cluster.broken_ranks() and time.monotonic() < deadline:
    time.sleep(0.1)
result = dict(named=lab.cluster.broken_ranks().get({rank}), note=lab.session.heal())
"""


@pytest.fixture(scope="module")
def network():
    with NetnsHosts(count=3) as hosts, SshHosts(hosts, on=(1, 2)) as ssh:
        yield hosts, ssh


def test_ssh_started_ranks_train_across_hosts_come_back_on_their_host_a_cut_host_is_dropped_stop_leaves_nothing(network):
    hosts, ssh = network
    driver = DriverClient(hosts, name="ssh")
    stopped = False
    try:
        started = driver.ask(240, command="start", ranks=4, launcher="ssh", controller_address=hosts.address(0),
                             timeout=60, start_timeout=180, threads_per_rank=1, **ssh.launcher_options({1: 2, 2: 2}))
        assert started["ok"], started
        ranks = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert sorted(host for _, host, _, _ in ranks) == ["lab-ssh1", "lab-ssh1", "lab-ssh2", "lab-ssh2"], ranks
        assert {host: place for _, host, _, place in ranks} == {"lab-ssh1": hosts.address(1),
                                                                "lab-ssh2": hosts.address(2)}, ranks

        trained = driver.ask(240, command="train", strategy="ddp", model="mlp", steps=4, verify=True)
        assert trained["ok"] and trained["world"] == 4 and trained["equivalent"] is True, trained

        # A rank on host 2 killed: the lab names it, and a heal starts its replacement there, through ssh.
        victim, _, pid, _ = next(rank for rank in ranks if rank[1] == "lab-ssh2")
        os.kill(pid, signal.SIGKILL)
        healed = driver.ask(240, command="exec", code=NAMED_THEN_HEALED.format(rank=victim))
        assert healed["ok"] and healed["result"]["named"], healed
        assert f"replaced rank {victim}" in healed["result"]["note"], healed
        after = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert after[victim][1] == "lab-ssh2" and after[victim][3] == hosts.address(2), after
        assert after[victim][2] != pid
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed

        # A rank on host 1 frozen while idle: the controller drops it, the heal kills it (its nanny is not frozen)
        # and starts its replacement on host 1.
        frozen, _, frozen_pid, _ = next(rank for rank in after if rank[1] == "lab-ssh1")
        os.kill(frozen_pid, signal.SIGSTOP)
        healed = driver.ask(240, command="exec", code=NAMED_THEN_HEALED.format(rank=frozen))
        assert healed["ok"] and "dropped by the controller" in (healed["result"]["named"] or ""), healed
        assert f"replaced rank {frozen}" in healed["result"]["note"], healed
        assert wait_for(lambda: not psutil.pid_exists(frozen_pid) or
                        psutil.Process(frozen_pid).status() == psutil.STATUS_ZOMBIE, 20), "the frozen rank was left"
        again = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert again[frozen][1] == "lab-ssh1" and again[frozen][3] == hosts.address(1), again
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed

        # Host 2 cut off the network: its ranks are dropped by the controller; the heal finds that ssh no longer
        # reaches the host, names it, and drops them (the ranks after them renumbered) rather than wait for
        # engines that cannot start there. The two ranks on host 1 go on as a world of 2.
        on_host2 = sorted(rank for rank, host, _, _ in again if host == "lab-ssh2")
        hosts.cut(2)
        healed = driver.ask(240, command="exec", code=NAMED_THEN_HEALED.format(rank=on_host2[-1]))
        note = healed["result"]["note"] if healed["ok"] else ""
        assert f"dropped ranks {on_host2[0]}, {on_host2[1]}: its host {hosts.address(2)} cannot be reached over ssh" \
            in note, healed
        assert "the lab now has 2 ranks" in note, healed
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [2.0] * 2, summed
        left = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert [host for _, host, _, _ in left] == ["lab-ssh1", "lab-ssh1"], left
        hosts.restore(2)

        stopped = driver.ask(90, command="stop")["ok"]
        assert stopped
    finally:
        if not stopped:
            driver.ask(90, command="stop")
    # Nothing of the lab is left on either host once it stopped: engines, nannies, ssh sessions.
    for host in (1, 2):
        assert wait_for(lambda: ssh.remote_pids(host) == [], 30), (host, ssh.remote_pids(host))
