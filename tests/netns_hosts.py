"""Hosts for multi-host tests, made of Linux network namespaces.

``NetnsHosts(count=3)`` builds ``count`` "hosts" that each have their own network stack and
their own IPv4 address (198.18.0.1, .2, ... in the 198.18.0.0/24 benchmarking range), joined
by one Ethernet bridge, so a test can run processes "on" different hosts, have them talk over
real addresses, and cut one host off the network::

    with NetnsHosts(count=3) as hosts:
        server = hosts.popen(0, [sys.executable, "server.py", hosts.address(0)])
        subprocess.run(hosts.command(2, [sys.executable, "client.py", hosts.address(0)]))
        hosts.cut(2)        # host 2 can no longer reach anyone, nor be reached
        hosts.restore(2)

Nothing is made in, or changed on, the machine's own (root) network namespace: the bridge
lives in a namespace of its own, and each veth pair is created inside that namespace, one end
then moved into its host's namespace. Names carry the owning pid and a random tag, so
parallel test runs never collide, and ``remove_stale`` can tell leftovers of a dead run
(killed before it could clean up) from namespaces that are still in use.

Needs root and iproute2; ``netns_unavailable()`` says in words why a test must skip if not.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess

import psutil

PREFIX = "lktest"          # every namespace this module makes is named PREFIX-<pid>-<tag>-<role>
SUBNET = "198.18.0"        # RFC 2544 benchmarking range: never a real network's addresses
IP_TIMEOUT = 10.0          # seconds any one `ip` call may take


class NetnsError(RuntimeError):
    """An `ip` command failed or hung; the message names the command and its stderr."""


def ip(*args: str, timeout: float = IP_TIMEOUT) -> str:
    """Run ``ip ARGS``; return its stdout, or raise NetnsError naming the command and stderr."""
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(argv)}` timed out after {timeout:g} s") from None
    except OSError as error:  # `ip` missing or not executable
        raise NetnsError(f"`{' '.join(argv)}` could not start: {error}") from None
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list` prints "NAME (id: N)" or "NAME")."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs inside ``name``, then delete it. A process left inside would keep
    the namespace (and its interfaces) alive, unnamed, after `ip netns del` removed the name."""
    for pid in ip("netns", "pids", name).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    ip("netns", "del", name)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``prefix-<pid>-...`` whose pid is no longer alive: leftovers of a
    test run that was killed before it cleaned up. Returns the names deleted. (A recycled pid
    makes a leftover look alive; it is then kept until that pid, too, is gone.)"""
    removed = []
    for name in list_namespaces():
        owner = name[len(prefix) + 1:].split("-", 1)[0]
        if name.startswith(prefix + "-") and owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(name)
            removed.append(name)
    return removed


@functools.cache
def netns_unavailable() -> str | None:
    """None when network namespaces, veth pairs and bridges can be made here; otherwise why not,
    in words fit for ``pytest.skip``. Probes by really making (and deleting) a namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not running as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    try:
        ip("netns", "add", name)
    except NetnsError as error:
        return f"cannot create a network namespace: {error}"
    try:
        # Containers may allow `netns add` yet refuse the mount namespace `netns exec` needs.
        ip("netns", "exec", name, "true")
        ip("-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        ip("-n", name, "link", "add", "probebr", "type", "bridge")
        ip("-n", name, "link", "set", "probe1", "master", "probebr")
    except NetnsError as error:
        return f"network namespaces work but veth pairs or bridges do not: {error}"
    finally:
        try:
            ip("netns", "del", name)
        except NetnsError:
            pass
    return None


class NetnsHosts:
    """``count`` hosts (network namespaces) on one private bridge; host i has 198.18.0.(i+1)/24.

    Use as a context manager; ``close()`` (run on exit, also when building fails half-way)
    kills every process started with ``popen`` and deletes every namespace made.
    """

    def __init__(self, count: int = 2, *, timeout: float = IP_TIMEOUT):
        if not 1 <= count <= 254:
            raise ValueError(f"count must be 1..254 (one /24 of addresses), not {count}")
        self.count = count
        self.timeout = timeout
        tag = secrets.token_hex(2)
        base = f"{PREFIX}-{os.getpid()}-{tag}"
        self.bridge_namespace = f"{base}-br"
        self.names = [f"{base}-h{i}" for i in range(count)]
        # Interface names (kernel limit: 15 characters) need only be unique inside their own
        # namespace; the tag just makes them easy to tell apart in `ip` output.
        self._bridge = f"br{tag}"
        self._host_ends = [f"v{tag}h{i}" for i in range(count)]
        self._bridge_ends = [f"v{tag}b{i}" for i in range(count)]
        self._made: list[str] = []          # namespaces created so far, for close()
        self._processes: list[subprocess.Popen] = []
        self._closed = False

    def __enter__(self) -> NetnsHosts:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _ip(self, *args: str) -> str:
        return ip(*args, timeout=self.timeout)

    def _add_namespace(self, name: str) -> None:
        self._ip("netns", "add", name)
        self._made.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        self._ip("-n", br, "link", "add", self._bridge, "type", "bridge")
        self._ip("-n", br, "link", "set", self._bridge, "up")
        for i, host in enumerate(self.names):
            self._add_namespace(host)
            # Made inside the bridge namespace, so no end ever appears in the root namespace.
            self._ip("-n", br, "link", "add", self._host_ends[i], "type", "veth",
                     "peer", "name", self._bridge_ends[i])
            self._ip("-n", br, "link", "set", self._host_ends[i], "netns", host)
            self._ip("-n", br, "link", "set", self._bridge_ends[i], "master", self._bridge, "up")
            self._ip("-n", host, "addr", "add", f"{self.address(i)}/24", "dev", self._host_ends[i])
            self._ip("-n", host, "link", "set", self._host_ends[i], "up")

    def address(self, i: int) -> str:
        """Host i's IPv4 address, e.g. '198.18.0.1' for host 0."""
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def interface(self, i: int) -> str:
        """Name of the veth end inside host i (the one that carries its address)."""
        self._check(i)
        return self._host_ends[i]

    def bridge_interface(self, i: int) -> str:
        """Name of host i's link at the bridge (in ``bridge_namespace``): what it sends out is
        what host i receives, so a qdisc there shapes host i's incoming traffic."""
        self._check(i)
        return self._bridge_ends[i]

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside host i (pass it to subprocess)."""
        self._check(i)
        return ["ip", "netns", "exec", self.names[i], *map(str, argv)]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host i, in a new session (so its own process group, which
        ``close()`` kills as a whole if the process is still running then)."""
        if self._closed:
            raise RuntimeError("NetnsHosts is closed")
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(i, argv), **kwargs)
        self._processes.append(process)
        return process

    def cut(self, i: int) -> None:
        """Take host i off the network: its link goes down at both ends, so no packet passes
        either way (sends fail at once with 'network unreachable'; nothing arrives)."""
        self._check(i)
        self._ip("-n", self.bridge_namespace, "link", "set", self._bridge_ends[i], "down")
        self._ip("-n", self.names[i], "link", "set", self._host_ends[i], "down")

    def restore(self, i: int) -> None:
        """Undo ``cut(i)``. The address stays through a cut; its route comes back with the link."""
        self._check(i)
        self._ip("-n", self.bridge_namespace, "link", "set", self._bridge_ends[i], "up")
        self._ip("-n", self.names[i], "link", "set", self._host_ends[i], "up")

    def running_in(self, i: int, besides=()) -> list[str]:
        """What runs in host i but the pids ``besides`` (a server the test keeps), as 'PID COMMAND'."""
        self._check(i)
        return running(pid for pid in map(int, ip("netns", "pids", self.names[i]).split()) if pid not in besides)

    def close(self) -> None:
        """Kill the processes started with ``popen``, delete every namespace made (which
        deletes their interfaces), and check that none is left. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            # Only while the leader is unreaped: after that its pid (= the group id) may be reused.
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=self.timeout)
        errors = []
        for name in reversed(self._made):
            try:
                _delete_namespace(name)
            except NetnsError as error:
                errors.append(str(error))
        left = set(self._made) & set(list_namespaces())
        if errors or left:
            raise NetnsError(f"cleanup left namespaces {sorted(left)}: {'; '.join(errors)}")

    def _check(self, i: int) -> None:
        if not 0 <= i < self.count:
            raise IndexError(f"host {i} out of range (0..{self.count - 1})")


def running(pids) -> list[str]:
    """The processes among ``pids`` that still run (an exited child whose parent is gone stays a zombie where
    the machine's first process does not collect orphans: ended, not left running)."""
    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(process.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return alive
