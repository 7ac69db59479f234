"""A lab across three hosts built on this machine: network namespaces joined by a bridge.

The notebook side (``multihost_driver.py``) runs in host 0 with two ranks of its
own; an engine joins from each of hosts 1 and 2 with the join command, each in
its own UTS namespace so it has its own host name. They train DDP across the
hosts over the namespaces' addresses; then host 2's link is cut, and the lab
must name the lost rank within the cell's limit, shrink to the ranks it still
has, and train on. Nothing touches the machine's own network.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time

import pytest

from tests.multihost_driver import DriverClient
from tests.netns_hosts import NetnsHosts, netns_unavailable

pytestmark = [pytest.mark.lab, pytest.mark.skipif(netns_unavailable() is not None,
                                                   reason=f"network namespaces: {netns_unavailable()}")]

CELL_LIMIT = 25.0


def join(hosts: NetnsHosts, index: int, command: str, name: str) -> subprocess.Popen:
    """Run the join command in host ``index``, under a host name of its own."""
    shell = f"hostname {name} && exec {command}"
    return hosts.popen(index, ["unshare", "--uts", "sh", "-c", shell], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def wait_exit(process: subprocess.Popen, within: float) -> int | None:
    try:
        return process.wait(within)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture(scope="module")
def hosts():
    with NetnsHosts(count=3) as made:
        yield made


def test_ddp_across_three_hosts_then_a_cut_link_is_named_and_the_lab_shrinks(hosts):
    driver = DriverClient(hosts)
    started = driver.ask(120, command="start", ranks=2, controller_address=hosts.address(0), timeout=CELL_LIMIT,
                         start_timeout=90)
    assert started["ok"], started
    assert f"controller at {hosts.address(0)}" in started["plan"]
    joiners = [join(hosts, 1, started["join"], "lab-host1"), join(hosts, 2, started["join"], "lab-host2")]

    grown = driver.ask(150, command="grow", world=4, within=120)
    assert grown["ok"] and grown["world"] == 4, grown
    assert sorted(grown["hosts"][2:]) == ["lab-host1", "lab-host2"]  # joined in the order they came
    assert [place["host_index"] for place in grown["places"]] == [0, 0, 1, 2]
    assert [place["local_rank"] for place in grown["places"]] == [0, 1, 0, 0]
    on_host2 = grown["hosts"].index("lab-host2")
    assert "engine(s) joined from lab-host" in grown["printed"], grown["printed"]

    summed = driver.ask(60, command="all_reduce", rounds=5)
    assert summed["ok"] and summed["sums"] == [4.0] * 4, summed
    trained = driver.ask(180, command="train", strategy="ddp", model="mlp", steps=4, verify=True)
    assert trained["ok"] and trained["world"] == 4 and trained["equivalent"] is True, trained

    # Everything the lab listens on in host 0 is on the lab's address (or loopback), never everywhere.
    listening = driver.ask(30, command="listening")["listening"]
    assert listening and all(address in (hosts.address(0), "127.0.0.1") for address, _, _ in listening), listening
    assert any(address == hosts.address(0) for address, _, _ in listening)

    # Cut while the ranks work (a joined rank cut while idle is dropped before the next call, as a frozen one is).
    cutter = threading.Timer(3.0, hosts.cut, (2,))
    cutter.start()
    began = time.monotonic()
    cut = driver.ask(CELL_LIMIT + 90, command="all_reduce", rounds=10_000)
    named = time.monotonic() - began
    cutter.join()
    assert not cut["ok"], cut
    assert f"rank {on_host2} was dropped by the controller" in cut["error"], cut["error"]
    assert cut["world"] == 3, cut  # the joined rank cannot be restarted from here: the lab shrank
    assert named < CELL_LIMIT + 60, f"the lost rank was named after {named:.0f} s"

    again = driver.ask(180, command="train", strategy="ddp", model="mlp", steps=3, global_batch=24)
    assert again["ok"] and again["world"] == 3, again

    # Cut off from the controller, the joined engine gives up by itself: nothing is left on host 2.
    assert wait_exit(joiners[1], 60) is not None, "the cut-off engine on host 2 is still running"
    hosts.restore(2)

    stopped = driver.ask(60, command="stop")
    assert stopped["ok"], stopped
    assert wait_exit(joiners[0], 30) is not None, "the joined engine on host 1 outlived the lab"
    assert wait_exit(driver.process, 30) == 0


def test_an_encrypted_lab_admits_only_engines_with_its_keys(hosts):
    driver = DriverClient(hosts)
    started = driver.ask(120, command="start", ranks=1, controller_address=hosts.address(0), encrypt=True,
                         start_timeout=90)
    assert started["ok"], started
    token = started["join"].split()[-1]
    from labkit.cluster.join import decode_token, encode_token

    connection = decode_token(token)
    assert connection["curve_serverkey"], "an encrypted lab's token carries the controller's CurveZMQ key"
    # An engine that does not have the controller's key cannot even register: the lab stays at one rank.
    stranger = dict(connection, curve_serverkey=None)
    outsider = join(hosts, 2, shlex.join([sys.executable, "-m", "labkit", "join", encode_token(stranger)]),
                    "outsider")
    member = join(hosts, 1, started["join"], "member")
    grown = driver.ask(120, command="grow", world=2, within=90)
    assert grown["ok"] and grown["world"] == 2 and grown["hosts"] == [grown["hosts"][0], "member"], grown
    time.sleep(3)  # the outsider had as long as the member, and longer
    status = driver.ask(30, command="status")
    assert status["world"] == 2, status["status"]
    summed = driver.ask(60, command="all_reduce", rounds=3)
    assert summed["ok"] and summed["sums"] == [2.0, 2.0], summed
    assert driver.ask(60, command="stop")["ok"]
    assert wait_exit(member, 30) is not None
    outsider.kill()  # it never got in: nobody could tell it to leave
    assert wait_exit(driver.process, 30) == 0
