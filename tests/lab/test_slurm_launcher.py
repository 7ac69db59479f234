"""The lab's ranks started through Slurm, for real: slurmctld and two slurmd nodes on namespace hosts.

``NetnsHosts(count=3)``: the notebook's side (``multihost_driver.py``) and slurmctld run in host 0 (the login
node), hosts 1 and 2 are compute nodes with a slurmd each (``tests/netns_slurm.py``: Debian's slurm-wlm and
munge, configured in a temporary folder). ``Lab(ranks=4, launcher="slurm")`` with nothing else submits one
job with sbatch; its ranks come up on both nodes and DDP across them verifies equal to one process. Then the
faults a cluster has: a rank killed (named, replaced by a job of its own), the job cancelled with scancel
(its ranks named with the job's state, replaced), a node's slurmd killed (Slurm marks the node down and ends
the job; the ranks still running on that node are named as outside any allocation and replaced on the node
left). After ``stop()`` squeue lists nothing and nothing of the lab runs on either node.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.lab.test_launchers import wait_for
from tests.multihost_driver import DriverClient
from tests.netns_hosts import NetnsHosts
from tests.netns_slurm import SlurmHosts, slurm_unavailable

UNAVAILABLE = slurm_unavailable()
pytestmark = [pytest.mark.lab, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"slurm hosts: {UNAVAILABLE}")]

RANKS_OF = "result = [(r, c.host, c.pid, c.engine_set) for r, c in sorted(lab.cluster.records.items())]"
# In the driver: wait ({within} s at most) until the lab names ranks {ranks} broken, then heal; what it said.
NAMED_THEN_HEALED = """
import time
deadline = time.monotonic() + {within}
while not set({ranks}) <= set(lab.cluster.broken_ranks()) and time.monotonic() < deadline:
    time.sleep(0.2)
named = lab.cluster.broken_ranks()
result = dict(named={{rank: named.get(rank) for rank in {ranks}}}, note=lab.session.heal())
"""


@pytest.fixture(scope="module")
def network():
    with NetnsHosts(count=3) as hosts, SlurmHosts(hosts, nodes=(1, 2)) as slurm:
        yield hosts, slurm


def heal_after(driver, ranks, within: float = 30) -> dict:
    healed = driver.ask(within + 120, command="exec", code=NAMED_THEN_HEALED.format(ranks=sorted(ranks), within=within))
    assert healed["ok"], healed
    result = healed["result"]
    return dict(result, named={int(rank): said for rank, said in result["named"].items()})  # JSON's keys are text


def test_slurm_job_ranks_train_across_nodes_and_scancel_a_killed_slurmd_and_stop_are_handled(network):
    hosts, slurm = network
    node1, node2 = slurm.node_name(1), slurm.node_name(2)
    driver = DriverClient(hosts, name="slurm", environment=slurm.environment)
    stopped = False
    try:
        # More ranks than the cluster can ever hold: Slurm's reason, at once (not after start_timeout), and no
        # job left behind.
        refused = driver.ask(120, command="start", ranks=64, launcher="slurm", controller_address=hosts.address(0),
                             timeout=60, start_timeout=60, threads_per_rank=1)
        assert not refused["ok"] and "Slurm job 1 can never run as asked (PENDING, reason PartitionConfig" \
            in refused["error"], refused
        assert refused["seconds"] < 30 and slurm.jobs() == [], (refused, slurm.jobs())

        started = driver.ask(240, command="start", ranks=4, launcher="slurm", controller_address=hosts.address(0),
                             timeout=60, start_timeout=120, threads_per_rank=1)
        assert started["ok"], started
        ranks = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert sorted(host for _, host, _, _ in ranks) == [node1, node1, node2, node2], ranks
        (job,) = slurm.jobs()
        first_job = job.split()[0]
        assert "RUNNING" in job, job
        assert not [name for name in os.listdir(os.getcwd()) if name.endswith(".sbatch")], "a batch script was left here"

        trained = driver.ask(240, command="train", strategy="ddp", model="mlp", steps=4, verify=True)
        assert trained["ok"] and trained["world"] == 4 and trained["equivalent"] is True, trained

        # A rank killed: named, replaced by a job of its own; the first job keeps its other three ranks.
        victim, _, pid, _ = ranks[3]
        os.kill(pid, signal.SIGKILL)
        healed = heal_after(driver, [victim])
        assert healed["named"][victim] and f"replaced rank {victim}" in healed["note"], healed
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed
        assert len(slurm.jobs()) == 2, slurm.jobs()

        # A rank frozen (SIGSTOP) while idle: the controller drops it; the heal kills it on its node with a job
        # step beside it (it would otherwise stay there, frozen, until its job ends) and replaces it.
        frozen, _, frozen_pid, _ = ranks[0]
        os.kill(frozen_pid, signal.SIGSTOP)
        healed = heal_after(driver, [frozen])
        assert "dropped by the controller" in (healed["named"][frozen] or "") and \
            f"replaced rank {frozen}" in healed["note"], healed
        assert wait_for(lambda: not psutil.pid_exists(frozen_pid) or
                        psutil.Process(frozen_pid).status() == psutil.STATUS_ZOMBIE, 20), "the frozen rank was left"
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed
        ranks = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        victim = 3

        # The first job cancelled with scancel: its two ranks left are named with the job's state, and replaced.
        cancelled = slurm.command(["scancel", first_job])
        assert cancelled.returncode == 0, cancelled
        others = [rank for rank, _, _, engine_set in ranks if engine_set == "ranks1"]
        assert others == [1, 2], ranks
        healed = heal_after(driver, others)
        for rank in others:
            assert f"Slurm job {first_job} was cancelled" in healed["named"][rank], healed
        assert "replaced ranks 1, 2" in healed["note"], healed
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed
        assert all(first_job != line.split()[0] for line in slurm.jobs()), slurm.jobs()

        # Node 2's slurmd killed: the ranks there keep running, but Slurm marks the node down and ends its
        # jobs. Every rank whose job ended is named (those on node 2 as outside any allocation), and replaced
        # where Slurm has room: node 1.
        placed = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        on_node2 = [rank for rank, host, _, _ in placed if host == node2]
        assert on_node2, placed
        slurm.kill_slurmd(2)
        healed = heal_after(driver, on_node2, within=90)
        for rank in on_node2:
            assert f"node {node2} failed" in (healed["named"][rank] or ""), healed
        assert "replaced rank" in healed["note"], healed
        after = driver.ask(30, command="exec", code=RANKS_OF)["result"]
        assert {host for _, host, _, _ in after} == {node1}, after
        summed = driver.ask(60, command="all_reduce", rounds=3)
        assert summed["ok"] and summed["sums"] == [4.0] * 4, summed
        assert not any("ipyparallel" in line for line in slurm.node_pids(2)), slurm.node_pids(2)

        # The node's slurmd back: Slurm returns it to service and it ends what was left of the failed job.
        slurm.start_slurmd(2)
        slurm.wait_idle([2], timeout=60)

        stopped = driver.ask(90, command="stop")["ok"]
        assert stopped
    finally:
        if not stopped:
            driver.ask(90, command="stop")
    # stop() waits until squeue no longer lists the lab's jobs; nothing of the lab runs on either node.
    assert slurm.jobs() == []
    for node in (1, 2):
        assert wait_for(lambda: slurm.node_pids(node) == [], 20), (node, slurm.node_pids(node))
