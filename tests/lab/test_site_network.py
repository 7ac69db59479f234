"""SiteNetwork for real: the firewalls let each site out only to the hub's HTTPS port (a proxied
site only through tinyproxy's CONNECT), nothing in; the links are shaped as configured; a cut
site is off the network until restored; and nothing is left behind, whether the network is
closed, fails half-built, or its owner is killed."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.netns_hosts import NetnsError, list_namespaces
from tests.netns_sites import SiteNetwork, remove_stale_sites, shaping_kind, site_network_unavailable
from tests.site_firewall import firewall_tool

if (reason := site_network_unavailable(shaping=False)) is not None:
    pytest.skip(reason, allow_module_level=True)

SHAPING_UNAVAILABLE = site_network_unavailable()   # None where netem works
needs_delay = pytest.mark.skipif(shaping_kind() not in ("netem", "tbf+nfqueue"),
                                 reason=f"no delay on the links: {SHAPING_UNAVAILABLE}, and no NFQUEUE for iptables")
needs_rate = pytest.mark.skipif(shaping_kind() is None, reason="links unshaped: this kernel has neither netem nor tbf")
DELAY_S, RATE_BYTES_S = 0.040, 50e6 / 8           # SiteNetwork's defaults: 40ms, 50mbit
ROOT = Path(__file__).resolve().parents[2]

# Times five TCP connects to ADDRESS PORT; prints the shortest, in seconds.
CONNECT_TIME = r"""
import socket, sys, time
times = []
for _ in range(5):
    started = time.perf_counter()
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    times.append(time.perf_counter() - started)
print(min(times))
"""

# One bulk transfer: "server ADDRESS PORT send|receive SIZE" listens (says "ready") and serves
# one connection; "client ADDRESS PORT send|receive SIZE" connects. The receiving side prints
# its bytes per second, not counting the first MB (TCP's slow start).
BULK = r"""
import socket, sys, time
role, address, port, direction, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if role == "server":
    server = socket.create_server((address, port))
    print("ready", flush=True)
    connection, _ = server.accept()
else:
    connection = socket.create_connection((address, port), timeout=30)
connection.settimeout(30)
if direction == "send":
    connection.sendall(b"\0" * size)
    connection.shutdown(socket.SHUT_WR)
    connection.recv(1)
else:
    got, started = 0, None
    while chunk := connection.recv(1 << 16):
        got += len(chunk)
        if started is None and got >= 1 << 20:
            started, counted_from = time.perf_counter(), got
    print((got - counted_from) / (time.perf_counter() - started), flush=True)
"""


@pytest.fixture(scope="module")
def network():
    with SiteNetwork(sites=3, proxied=(3,)) as made:   # netem where the kernel has it, else tbf and link_delay.py
        yield made


def test_where_things_are(network):
    assert network.hub_address == "198.18.0.1"
    assert [network.site_address(i) for i in (1, 2, 3)] == ["198.18.0.2", "198.18.0.3", "198.18.0.4"]
    assert network.proxy_address == "198.18.0.5" and network.proxy_url == "http://198.18.0.5:8888"
    assert network.site_host(2) == 2 and network.namespace(0) in list_namespaces()
    with pytest.raises(IndexError):
        network.site_host(4)


def test_isolation(network):
    started = time.monotonic()
    reached = network.check_isolation(timeout=2.0)
    took = time.monotonic() - started
    assert_isolated(network, reached)
    # All at once, each bounded: about the 2 s timeout here, plus the helpers' start (10.8 s seen
    # in an emulated VM, where each python takes seconds to start).
    assert took < 2.0 + 20.0, f"the checks took {took:.1f} s"


@pytest.mark.skipif(shutil.which("iptables-restore") is None, reason="iptables is not installed: apt-get install iptables")
def test_isolation_with_the_iptables_fallback():
    with SiteNetwork(sites=3, proxied=(3,), delay=None, rate=None, firewall="iptables") as network:
        assert_isolated(network, network.check_isolation(timeout=2.0))


def assert_isolated(network, reached) -> None:
    assert reached == network.expected_isolation()
    # What the fixture promises, spelled out (the expectations above are the fixture's own):
    assert reached["site1->hub:8443"] and reached["site2->hub:8443"]         # direct: out over HTTPS
    assert reached["site3->proxy->hub:8443"]                                # proxied: via CONNECT
    assert not reached["site3->hub:8443"] and not reached["site3->proxy->hub:5555"]
    assert not reached["site3->proxy->site1:8443"]                          # the proxy reaches only the hub
    assert not reached["site1->proxy:8888"]                                 # a direct site has no proxy
    assert not any(reached[key] for key in ("site1->site2:5555", "site2->site1:8443", "site1->hub:5555",
                                            "hub->site1:5555", "hub->site2:8443", "hub->site3:5555"))
    assert all(reached[f"site{i}->site{i}:5555"] for i in (1, 2, 3))         # the listeners were up


def test_a_cut_site_cannot_reach_the_hub_until_restored(network):
    hub, site1, site2 = network.hub_host, network.site_host(1), network.site_host(2)
    with network.listening({hub: [network.https_port]}):
        assert network.reaches(site1, hub, 8443)
        network.cut(1)
        try:
            started = time.monotonic()
            assert not network.reaches(site1, hub, 8443, timeout=1.5)
            assert time.monotonic() - started < 1.5 + 10  # bounded (the helper's start: seconds in a VM)
            assert network.reaches(site2, hub, 8443)                            # the others go on
        finally:
            network.restore(1)
        assert network.reaches(site1, hub, 8443)
    if SHAPING_UNAVAILABLE is None:  # a link taken down and up keeps its qdiscs
        assert all("netem" in shown for shown in qdiscs(network, site1))


@needs_rate
def test_both_ends_of_each_site_link_are_shaped(network):
    for site in (1, 2, 3):
        for shown in qdiscs(network, network.site_host(site)):
            if network.shaper == "netem":
                assert "netem" in shown and "delay 40ms" in shown and "rate 50Mbit" in shown, shown
            else:
                assert "tbf" in shown and "rate 50Mbit" in shown, shown
    assert network.links == {
        "netem": "40ms delay each way, 50mbit each way (tc netem)",
        "tbf+nfqueue": "40ms delay each way, 50mbit each way (rate: tc tbf; delay: packets held in user space "
                       "through NFQUEUE, this kernel has no netem)",
        "tbf": "50mbit each way (tc tbf: this kernel has no netem, so no delay)"}[network.shaper]


def qdiscs(network, host) -> list[str]:
    """`tc qdisc show` of host ``host``'s link: its own end, then the bridge's."""
    ends = ((network.namespace(host), network.hosts.interface(host)),
            (network.hosts.bridge_namespace, network.hosts.bridge_interface(host)))
    return [subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", device],
                           capture_output=True, text=True, check=True).stdout for namespace, device in ends]


@needs_delay
def test_connect_time_is_the_round_trip(network):
    with network.listening({network.hub_host: [network.https_port]}):
        done = subprocess.run(network.command(network.site_host(1), [
            sys.executable, "-c", CONNECT_TIME, network.hub_address, network.https_port]),
            capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    connect_s, rtt = float(done.stdout), 2 * DELAY_S
    print(f"TCP connect site1->hub:8443 took {connect_s * 1000:.1f} ms (configured RTT {rtt * 1000:.0f} ms)")
    assert rtt <= connect_s < rtt + 0.050


@needs_rate
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_bulk_transfer_runs_near_the_rate(network, direction):
    size, hub, site = 6 << 20, network.hub_host, network.site_host(1)
    server_does, client_does = ("receive", "send") if direction == "upload" else ("send", "receive")
    address_port = [network.hub_address, network.https_port]
    server = network.popen(hub, [sys.executable, "-c", BULK, "server", *address_port, server_does, size],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(network.command(site, [sys.executable, "-c", BULK, "client", *address_port,
                                                       client_does, size]),
                                capture_output=True, text=True, timeout=30)
        assert client.returncode == 0, client.stderr
        out, _ = server.communicate(timeout=30)
    finally:
        server.kill()
    rate = float(out if direction == "upload" else client.stdout)
    print(f"{direction} of {size >> 20} MB: {rate * 8 / 1e6:.1f} Mbit/s (configured 50 Mbit/s)")
    assert 0.5 * RATE_BYTES_S <= rate <= 1.2 * RATE_BYTES_S


def test_a_flat_network_has_the_same_links_and_no_firewall():
    with SiteNetwork(sites=2, proxied=(), firewall="off") as flat:
        # what the firewalled network refuses, a flat one lets through: site to site, any port of the hub
        with flat.listening({flat.site_host(2): [flat.probe_port], flat.hub_host: [flat.probe_port]}):
            assert flat.reaches(flat.site_host(1), flat.site_host(2), flat.probe_port)
            assert flat.reaches(flat.site_host(1), flat.hub_host, flat.probe_port)
        assert flat.proxy_host is None
        if flat.shaper is not None:
            assert all("rate 50Mbit" in shown for shown in qdiscs(flat, flat.site_host(1)))
        if flat.delay:  # site to site crosses two shaped links: twice the hub's round trip
            with flat.listening({flat.site_host(2): [flat.probe_port]}):
                done = subprocess.run(flat.command(flat.site_host(1), [
                    sys.executable, "-c", CONNECT_TIME, flat.site_address(2), flat.probe_port]),
                    capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            assert 4 * DELAY_S <= float(done.stdout) < 4 * DELAY_S + 0.050, done.stdout


def test_close_leaves_nothing():
    network = SiteNetwork(sites=1, proxied=(1,), delay=None, rate=None).__enter__()
    names = [*network.hosts.names, network.hosts.bridge_namespace]
    proxy, folder = network.proxy_process, network.folder
    assert set(names) <= set(list_namespaces()) and proxy.poll() is None and folder.is_dir()
    network.close()
    assert_gone(names, proxy.pid, folder)
    assert proxy.returncode is not None
    network.close()  # idempotent


@pytest.mark.parametrize("failing", ["firewall", "proxy"])
def test_a_network_failing_half_built_leaves_nothing(monkeypatch, failing):
    seen = {}

    def fail_waiting(self):  # tinyproxy started, namespaces, firewalls made: then it fails
        seen.update(pid=self.proxy_process.pid)
        raise NetnsError("made to fail")

    monkeypatch.setattr(SiteNetwork, "_wait_for_proxy", fail_waiting)
    network = SiteNetwork(sites=2, proxied=(2,), delay=None, rate=None,
                          https_port=70000 if failing == "firewall" else 8443)  # no such port: nft refuses
    with pytest.raises(NetnsError, match="made to fail" if failing == "proxy" else "nft -f"):
        network.__enter__()  # what `with` calls; on its failure nothing else would clean up
    assert_gone([*network.hosts.names, network.hosts.bridge_namespace], seen.get("pid"), network.folder)


def test_leftovers_of_a_killed_run_are_removed():
    build_and_hang = ("import time; from tests.netns_sites import SiteNetwork\n"
                      "n = SiteNetwork(sites=1, proxied=(1,), delay=None, rate=None).__enter__()\n"
                      "print(n.proxy_process.pid, n.folder, n.hosts.bridge_namespace, *n.hosts.names, flush=True)\n"
                      "time.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", build_and_hang], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid, folder, *names = owner.stdout.readline().split()
    finally:
        owner.send_signal(signal.SIGKILL)  # no close(): all of it is left behind
        owner.wait(10)
        owner.stdout.close()
    assert set(names) <= set(list_namespaces()) and psutil.Process(int(pid)).name() == "tinyproxy"
    remove_stale_sites()
    assert_gone(names, int(pid), Path(folder))


def test_unavailable_says_what_to_install(monkeypatch):
    which = shutil.which

    def without(*missing):
        monkeypatch.setattr(shutil, "which", lambda tool: None if tool in missing else which(tool))
        return site_network_unavailable.__wrapped__(shaping=True)

    assert "apt-get install tinyproxy" in without("tinyproxy")
    assert "apt-get install iproute2" in without("tc")
    assert "apt-get install nftables (or iptables)" in without("nft", "iptables-restore")
    without("nft")
    assert firewall_tool() == "iptables"  # the fallback


def assert_gone(names, proxy_pid, folder) -> None:
    """No namespace of ``names``, no live tinyproxy ``proxy_pid``, no ``folder``, and no process
    at all still naming the folder (tinyproxy runs with its config in there)."""
    assert not set(names) & set(list_namespaces())
    if proxy_pid is not None:
        assert not alive(proxy_pid)
    assert folder is None or not folder.exists()
    assert not [p.pid for p in psutil.process_iter(["cmdline"])
                if folder is not None and str(folder) in " ".join(p.info["cmdline"] or []) and alive(p.pid)]


def alive(pid: int) -> bool:
    """Running, not a zombie (one whose parent was killed waits here for a reaper that may not come)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
