"""Remote sites as behind NAT or a corporate firewall, made of network namespaces.

``SiteNetwork`` builds, on ``NetnsHosts``, the network a lab meets when its machines are not on
one LAN: host 0 is the hub (the notebook's machine); hosts 1..sites are remote sites, each behind
a firewall that, like NAT, lets no connection in, and lets out only TCP to the hub's HTTPS port
(there is no address translation: the firewall alone decides who reaches whom); the sites in
``proxied`` may not even do that: their one way out is an HTTP CONNECT proxy (Debian's
tinyproxy, on a host of its own), which in turn may open only the hub's HTTPS port. Each site's
link is shaped (tc netem: delay and rate, both directions; where the kernel has no netem, tbf
limits the rate and ``tests/link_delay.py`` holds arriving packets in user space for the delay,
through NFQUEUE rules; ``links`` says which)::

    with SiteNetwork(sites=3, proxied=(3,)) as network:
        hub = network.popen(network.hub_host, [sys.executable, "server.py", network.hub_address])
        client = network.command(network.site_host(3), [sys.executable, "client.py",
                                                        "--proxy", network.proxy_url])
        assert network.check_isolation() == network.expected_isolation()
        network.cut(1)       # site 1 off the network; network.restore(1) brings it back

``listening({host: [ports]})`` and ``reaches(source, target, port, via_proxy=...)`` let a test
check one connection of its own the way ``check_isolation`` checks them all.

Round-trip times: every packet through a site's link waits ``delay`` once, so site <-> hub and
site <-> proxy take 2 x delay (80 ms by default), a proxied site -> proxy -> hub too (the
proxy's and the hub's own links are not shaped); each direction of a site's link carries at
most ``rate`` on its own. ``delay=None, rate=None`` leaves the links unshaped. ``links`` says in
words what the links are. Addresses: hub 198.18.0.1, site i 198.18.0.(i+1), proxy after the last site.

``firewall="off"`` builds the same hosts and links with no firewall at all: a flat network, where
every host reaches every other (what torch.distributed across the sites would need), for comparisons.

The firewall is nftables (one ``nft -f`` ruleset per host), or iptables-restore where nft is
missing. Everything lives in namespaces and a temporary folder; ``close()`` (also on a
half-built network) removes all of it, and leftovers of a killed run are removed the next time
one is built. ``site_network_unavailable()`` says in words why a test must skip, and what to
install.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from tests.netns_hosts import PREFIX, NetnsError, NetnsHosts, ip, netns_unavailable, remove_stale
from tests.site_firewall import HostRules, firewall_tool, load_firewall
from tests.site_probes import LISTENER, PROBER, Probe, read_line, stop, wait_accepting

PROBE_PORT = 5555        # a port that must stay closed: sites and the hub listen on it in checks
HELPER_TIMEOUT = 10.0    # seconds a helper may take to start, or a command to finish


def remove_stale_sites() -> None:
    """Remove what killed runs left: their namespaces (killing what ran inside, tinyproxy
    included) and their temporary folders (named after the pid that made them)."""
    remove_stale()
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-sites-*"):
        owner = folder.name.split("-")[1]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)


def run_checked(argv: list[str], what: str) -> str:
    """Run ``argv``; its stdout, or NetnsError saying ``what`` failed and why."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HELPER_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsError(f"{what}: `{' '.join(argv)}`: {error}") from None
    if done.returncode != 0:
        raise NetnsError(f"{what}: `{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def _probe_qdisc(namespace: str, qdisc: list[str]) -> bool:
    try:
        run_checked(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", *qdisc], "adding a qdisc")
    except NetnsError:
        return False
    run_checked(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], "removing a qdisc")
    return True


def milliseconds(span: str) -> float:
    """'40ms', '0.5s' or '200us' (tc's spellings) in milliseconds."""
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1000.0)):
        if span.endswith(unit):
            return float(span[:-len(unit)]) * scale
    raise ValueError(f"a delay is like '40ms', not {span!r}")


# tbf's bucket: at least one packet of 64 kB (what veth's offloads hand it at once), and a queue of
# 400 ms at the rate before it drops, as a home router's buffer would.
TBF = ["burst", "64kb", "latency", "400ms"]


@functools.cache
def shaping_kind() -> str | None:
    """How this machine can shape a link: 'netem' (delay and rate in the kernel), 'tbf+nfqueue' (tbf's rate,
    and delay by holding packets in user space: ``tests/link_delay.py``), 'tbf' (rate only), or None."""
    if os.geteuid() != 0 or shutil.which("tc") is None or netns_unavailable() is not None:
        return None
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-qdisc"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "set", "lo", "up")
        if _probe_qdisc(probe, ["netem", "delay", "1ms", "rate", "1mbit"]):
            return "netem"
        if not _probe_qdisc(probe, ["tbf", "rate", "1mbit", *TBF]):
            return None
        try:
            run_checked(["ip", "netns", "exec", probe, "iptables", "-t", "mangle", "-A", "PREROUTING", "-s",
                         "192.0.2.1", "-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass"], "adding an NFQUEUE rule")
        except NetnsError:
            return "tbf"
        return "tbf+nfqueue"
    except NetnsError:
        return None
    finally:
        with contextlib.suppress(NetnsError):
            ip("netns", "del", probe)


@functools.cache
def site_network_unavailable(shaping: bool = True) -> str | None:
    """None when a SiteNetwork can be built here (with shaped links unless ``shaping=False``);
    otherwise why not, naming what to install. Probes for real in a throwaway namespace."""
    if os.geteuid() != 0:
        return "a site network needs root (namespaces, firewalls, qdiscs): run the tests as root"
    tools = [("ip", "iproute2"), ("tinyproxy", "tinyproxy")] + ([("tc", "iproute2")] if shaping else [])
    for tool, package in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install {package}"
    if firewall_tool() is None:
        return "neither `nft` nor `iptables-restore` is installed: apt-get install nftables (or iptables)"
    if (reason := netns_unavailable()) is not None:
        return reason
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "set", "lo", "up")
        try:
            load_firewall(["ip", "netns", "exec", probe], HostRules(), firewall_tool())
        except NetnsError as error:
            return f"cannot load a firewall into a network namespace: {error}"
        if shaping:
            try:
                run_checked(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                             "delay", "1ms", "rate", "1mbit"], "adding a netem qdisc")
            except NetnsError as error:
                return (f"this kernel has no netem qdisc ({error}): load it (modprobe sch_netem; on "
                        "Ubuntu it is in linux-modules-extra-$(uname -r)) or use a kernel built "
                        "with CONFIG_NET_SCH_NETEM; or build the network unshaped (delay=None, rate=None)")
    except NetnsError as error:
        return f"cannot build a probe namespace: {error}"
    finally:
        with contextlib.suppress(NetnsError):
            ip("netns", "del", probe)
    return None


class SiteNetwork:
    """A hub, ``sites`` firewalled sites (those in ``proxied`` behind an HTTP CONNECT proxy) and,
    when any is proxied, the proxy's host; see the module docstring. A context manager."""

    def __init__(self, sites: int = 3, proxied: tuple[int, ...] = (3,), https_port: int = 8443,
                 proxy_port: int = 8888, delay: str | None = "40ms", rate: str | None = "50mbit",
                 *, firewall: str = "auto"):
        if sites < 1 or not set(proxied) <= set(range(1, sites + 1)):
            raise ValueError(f"need sites >= 1 and proxied among 1..{sites}, not {sites}, {proxied}")
        if firewall not in ("auto", "nft", "iptables", "off"):
            raise ValueError(f"firewall is 'auto', 'nft', 'iptables' or 'off', not {firewall!r}")
        self.sites, self.proxied = sites, tuple(sorted(set(proxied)))
        self.https_port, self.proxy_port = https_port, proxy_port
        self.delay, self.rate = delay, rate
        # What the kernel can do decides what the links get: without netem, tbf keeps the rate and no delay.
        self.shaper = shaping_kind() if (delay or rate) else None
        if self.shaper not in ("netem", "tbf+nfqueue"):
            self.delay = None
        if self.shaper is None:
            self.rate = None
        self.probe_port = PROBE_PORT if PROBE_PORT not in (https_port, proxy_port) else 15555
        self.firewall = firewall_tool() if firewall == "auto" else firewall
        self.hosts = NetnsHosts(count=1 + sites + (1 if self.proxied else 0))
        self.hub_host = 0
        self.proxy_host = sites + 1 if self.proxied else None
        self.proxy_process: subprocess.Popen | None = None
        self.folder: Path | None = None   # the rulesets and tinyproxy's config, log, pid file
        self.delayers: dict[int, subprocess.Popen] = {}  # host -> its link_delay.py, where netem is missing
        self._closed = False

    # -- building ------------------------------------------------------------------------------

    def __enter__(self) -> SiteNetwork:
        remove_stale_sites()
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-sites-"))
            self.hosts.__enter__()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        if self.firewall is None:
            raise NetnsError("neither nft nor iptables-restore is installed")
        for host in range(self.hosts.count if self.firewall != "off" else 0):
            rules_file = self.folder / f"firewall-{self.host_name(host)}"
            load_firewall(self.hosts.command(host, []), self._rules(host), self.firewall, rules_file)
        if self.shaper is not None and (self.delay or self.rate):
            for site in range(1, self.sites + 1):
                self._shape(self.site_host(site))
        if self.shaper == "tbf+nfqueue" and self.delay:
            for host in range(self.hosts.count):
                self._hold_arrivals(host)
        if self.proxied:
            self._start_proxy()
            self._wait_for_proxy()

    def _rules(self, host: int) -> HostRules:
        """What host ``host`` may receive and send besides loopback and replies."""
        hub = (self.hub_address, self.https_port)
        if host == self.hub_host:   # takes HTTPS from anyone; may open anything (it is ours)
            return HostRules(accept_in=[(None, self.https_port)], output_open=True)
        if host == self.proxy_host:
            return HostRules(accept_in=[(self.site_address(i), self.proxy_port) for i in self.proxied],
                             accept_out=[hub])
        if host in map(self.site_host, self.proxied):
            return HostRules(accept_out=[(self.proxy_address, self.proxy_port)])
        return HostRules(accept_out=[hub])

    def _shape(self, host: int) -> None:
        # The host's own end delays and limits what it sends; the bridge's end what it receives.
        if self.shaper == "netem":
            shaping = ["netem"] + (["delay", self.delay] if self.delay else []) + (["rate", self.rate] if self.rate else [])
        else:
            shaping = ["tbf", "rate", self.rate, *TBF]
        for namespace, device in ((self.hosts.names[host], self.hosts.interface(host)),
                                  (self.hosts.bridge_namespace, self.hosts.bridge_interface(host))):
            run_checked(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *shaping],
                        f"shaping {self.host_name(host)}'s link")

    def _link_delay_ms(self, host: int) -> float:
        return milliseconds(self.delay) if 1 <= host <= self.sites else 0.0

    def _hold_arrivals(self, host: int) -> None:
        """Without netem: hold what arrives at ``host`` from each other host for the delays of both links it
        crossed (``tests/link_delay.py``, one queue per delay), as netem on both ends of each link would."""
        by_delay: dict[float, list[int]] = {}
        for source in range(self.hosts.count):
            total = self._link_delay_ms(host) + self._link_delay_ms(source)
            if source != host and total > 0:
                by_delay.setdefault(total, []).append(source)
        if not by_delay:
            return
        queues = {queue: delay for queue, delay in enumerate(sorted(by_delay), start=1)}
        self.delayers[host] = self.popen(host, [sys.executable, str(Path(__file__).with_name("link_delay.py")),
                                                *(f"{queue}:{delay:g}" for queue, delay in queues.items())],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        if read_line(self.delayers[host], HELPER_TIMEOUT) != b"ready\n":
            raise NetnsError(f"the link delay of {self.host_name(host)} did not start "
                             f"(exit {self.delayers[host].poll()})")
        for queue, delay in queues.items():
            for source in by_delay[delay]:
                run_checked(self.command(host, ["iptables", "-t", "mangle", "-A", "PREROUTING", "-s",
                                                self.hosts.address(source), "-j", "NFQUEUE", "--queue-num",
                                                str(queue), "--queue-bypass"]),
                            f"holding what {self.host_name(host)} gets from {self.host_name(source)}")

    def _start_proxy(self) -> None:
        folder = self.folder
        allow = "".join(f"Allow {self.site_address(i)}\n" for i in self.proxied)
        # Runs as root (no User): the proxy is sealed in its namespace by its firewall, and its
        # log and pid file stay in our folder. Foreground (-d), so the Popen is the proxy itself.
        (folder / "tinyproxy.conf").write_text(
            f"Port {self.proxy_port}\nListen {self.proxy_address}\nTimeout 60\nMaxClients 100\n"
            f'LogFile "{folder}/tinyproxy.log"\nLogLevel Info\nPidFile "{folder}/tinyproxy.pid"\n'
            f"{allow}ConnectPort {self.https_port}\nDisableViaHeader Yes\n")
        with open(folder / "tinyproxy.out", "wb") as output:
            self.proxy_process = self.hosts.popen(self.proxy_host, ["tinyproxy", "-d", "-c", folder / "tinyproxy.conf"],
                                                  stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)

    def _wait_for_proxy(self) -> None:
        accepting = wait_accepting(self.hosts, self.proxy_host, self.proxy_address, self.proxy_port, HELPER_TIMEOUT)
        if not accepting or self.proxy_process.poll() is not None:
            said = (self.folder / "tinyproxy.out").read_text(errors="replace")[-2000:]
            raise NetnsError(f"tinyproxy is not accepting on {self.proxy_address}:{self.proxy_port} "
                             f"(exit {self.proxy_process.poll()}): {said}")

    # -- where things are -----------------------------------------------------------------------

    @property
    def links(self) -> str:
        """What each site's link is, in words: its delay and rate, or why one is missing."""
        if self.shaper is None:
            return "unshaped"
        said = [f"{self.delay} delay each way" if self.delay else "", f"{self.rate} each way" if self.rate else ""]
        text = ", ".join(part for part in said if part) or "unshaped"
        return text + {"tbf": " (tc tbf: this kernel has no netem, so no delay)",
                       "tbf+nfqueue": " (rate: tc tbf; delay: packets held in user space through NFQUEUE, this "
                                      "kernel has no netem)"}.get(self.shaper, " (tc netem)")

    @property
    def hub_address(self) -> str:
        """The hub's address, 198.18.0.1: the one a site may reach (at ``https_port``)."""
        return self.hosts.address(self.hub_host)

    def site_host(self, site: int) -> int:
        """Host index of site ``site`` (1..sites)."""
        if not 1 <= site <= self.sites:
            raise IndexError(f"site {site} out of range (1..{self.sites})")
        return site

    def site_address(self, site: int) -> str:
        """Site ``site``'s address, 198.18.0.(site+1)."""
        return self.hosts.address(self.site_host(site))

    @property
    def proxy_address(self) -> str:
        if self.proxy_host is None:
            raise ValueError("this network has no proxy (proxied=())")
        return self.hosts.address(self.proxy_host)

    @property
    def proxy_url(self) -> str:
        """What a proxied site's client is given, e.g. 'http://198.18.0.5:8888'."""
        return f"http://{self.proxy_address}:{self.proxy_port}"

    def own_pids(self, host: int) -> set[int]:
        """The network's own processes in host ``host`` (its link delay, the proxy): not a test's leftovers."""
        own = {process.pid for where, process in self.delayers.items() if where == host}
        if host == self.proxy_host and self.proxy_process is not None:
            own.add(self.proxy_process.pid)
        return own

    def namespace(self, host: int) -> str:
        """The network namespace's name of host ``host`` (for `ip netns exec`, `tc -n`)."""
        return self.hosts.names[host]

    def host_name(self, host: int) -> str:
        """'hub', 'site<i>' or 'proxy': how check keys name host ``host``."""
        return "hub" if host == self.hub_host else "proxy" if host == self.proxy_host else f"site{host}"

    # -- running and cutting --------------------------------------------------------------------

    def command(self, host: int, argv: list) -> list[str]:
        """``argv`` prefixed to run inside host ``host`` (see NetnsHosts.command)."""
        return self.hosts.command(host, argv)

    def popen(self, host: int, argv: list, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``; killed by ``close()`` (see NetnsHosts.popen)."""
        return self.hosts.popen(host, argv, **kwargs)

    def cut(self, site: int) -> None:
        """Take site ``site``'s link down at both ends: it reaches no one, no one reaches it."""
        self.hosts.cut(self.site_host(site))

    def restore(self, site: int) -> None:
        """Undo ``cut(site)``; its firewall and shaping are as before."""
        self.hosts.restore(self.site_host(site))

    # -- checking -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def listening(self, ports_by_host: dict[int, list[int]]):
        """Throwaway listeners (each answers a connection with 'NAME:PORT') on those hosts'
        addresses, started together and ready inside the block; killed when it ends."""
        started = []
        try:
            for host, ports in ports_by_host.items():
                started.append(self.popen(host, [sys.executable, "-c", LISTENER, self.host_name(host),
                                                 self.hosts.address(host), *ports], stdout=subprocess.PIPE))
            for listener in started:
                if read_line(listener, HELPER_TIMEOUT) != b"ready\n":
                    raise NetnsError(f"a listener did not start (exit {listener.poll()}): {listener.args}")
            yield
        finally:
            for listener in started:
                stop(listener)

    def reaches(self, source: int, target: int, port: int, *, via_proxy: bool = False,
                timeout: float = 2.0) -> bool:
        """Whether a TCP client in host ``source`` gets through to a ``listening`` host ``target``
        at ``port`` (via the CONNECT proxy if asked), within ``timeout`` seconds."""
        probe = Probe("probe", source, target, port, via_proxy, expected=True)
        return self._run_probes([probe], timeout)["probe"]

    def isolation_probes(self) -> list[Probe]:
        """Every connection ``check_isolation`` tries, with what must come of it."""
        https, closed, hub = self.https_port, self.probe_port, self.hub_host
        probes = []
        for site in range(1, self.sites + 1):
            host, proxied = self.site_host(site), site in self.proxied
            name = self.host_name(host)
            # The control: the site's own listener answers it over loopback, so the failures
            # below are the firewalls' doing, not a listener that never came up.
            probes.append(Probe(f"{name}->{name}:{closed}", host, host, closed, False, True))
            for other in range(1, self.sites + 1):
                for port in (closed, https) if other != site else ():
                    probes.append(Probe(f"{name}->site{other}:{port}", host, other, port, False, False))
            probes.append(Probe(f"{name}->hub:{closed}", host, hub, closed, False, False))
            probes.append(Probe(f"{name}->hub:{https}", host, hub, https, False, not proxied))
            if proxied:
                probes.append(Probe(f"{name}->proxy->hub:{https}", host, hub, https, True, True))
                probes.append(Probe(f"{name}->proxy->hub:{closed}", host, hub, closed, True, False))
                probes += [Probe(f"{name}->proxy->site{other}:{https}", host, other, https, True, False)
                           for other in range(1, self.sites + 1) if other != site]
            elif self.proxied:
                probes.append(Probe(f"{name}->proxy:{self.proxy_port}", host, self.proxy_host,
                                    self.proxy_port, False, False))
            probes += [Probe(f"hub->{name}:{port}", hub, host, port, False, False) for port in (closed, https)]
        return probes

    def expected_isolation(self) -> dict[str, bool]:
        """What ``check_isolation`` must return: {key: whether that connection must get through}."""
        return {probe.key: probe.expected for probe in self.isolation_probes()}

    def check_isolation(self, timeout: float = 2.0) -> dict[str, bool]:
        """Try every connection of ``isolation_probes`` for real, all at once (so it takes about
        ``timeout``: a dropped SYN just waits), against listeners on the hub's HTTPS and probe
        ports and on each site's; returns {key: whether it got through}."""
        listeners = {self.hub_host: [self.https_port, self.probe_port]}
        listeners |= {self.site_host(i): [self.probe_port, self.https_port] for i in range(1, self.sites + 1)}
        with self.listening(listeners):
            return self._run_probes(self.isolation_probes(), timeout)

    def _run_probes(self, probes: list[Probe], timeout: float) -> dict[str, bool]:
        by_source: dict[int, list] = {}
        for probe in probes:
            target = self.hosts.address(probe.target)
            greeting = None if probe.target == self.proxy_host else f"{self.host_name(probe.target)}:{probe.port}"
            if probe.via_proxy:
                spec = [probe.key, self.proxy_address, self.proxy_port, f"{target}:{probe.port}", greeting]
            else:
                spec = [probe.key, target, probe.port, None, greeting]
            by_source.setdefault(probe.source, []).append(spec)
        probers = []
        results: dict[str, bool] = {}
        try:
            for source, specs in by_source.items():
                probers.append(self.popen(source, [sys.executable, "-c", PROBER, timeout, json.dumps(specs)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            for prober in probers:
                out, err = prober.communicate(timeout=timeout + HELPER_TIMEOUT)
                if prober.returncode != 0:
                    raise NetnsError(f"a prober failed (exit {prober.returncode}): {err.decode()[-2000:]}")
                results |= json.loads(out)
        finally:
            for prober in probers:
                stop(prober)
        return results

    # -- cleaning up ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop tinyproxy, delete every namespace (killing whatever still runs in them) and the
        temporary folder. Safe to call more than once, and on a half-built network."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.proxy_process is not None:
                stop(self.proxy_process, signal.SIGTERM)
            self.hosts.close()
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)


class SiteProcess:
    """The lab's HTTPS join command run inside one site host (its own process group), as ``name`` with
    ``ranks`` ranks, through the proxy where the site is proxied; its output goes to ``log_dir/NAME.log``."""

    def __init__(self, network: SiteNetwork, site: int, command: str, name: str, ranks: int, cafile: str | None,
                 log_dir: Path) -> None:
        self.network, self.site, self.name = network, site, name
        self.log = log_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for variable in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
            env.pop(variable, None)
        if site in network.proxied:
            env["https_proxy"] = network.proxy_url  # the one way out of this host
        argv = [sys.executable, "-m", "labkit", "join", command.split()[-1], "--ranks", str(ranks), "--name", name,
                *(["--cafile", cafile] if cafile else [])]  # without a CA: the lab's own certificate, pinned
        self.process = network.popen(network.site_host(site), argv, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
