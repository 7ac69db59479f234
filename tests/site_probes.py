"""The small programs ``tests/netns_sites.py`` runs inside its namespaces to check who reaches
whom (throwaway listeners, a prober, a wait for a port), and how it stops them.

Each runs as ``sys.executable -c PROGRAM ARGS`` under `ip netns exec`. The prober and the wait
bound their own time; a listener runs until ``stop`` ends it (with its process group), which
ends any of them whatever state it is in.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from typing import NamedTuple

# Listens on the ports given; each connection gets "NAME:PORT\n" (so a client knows whom it
# reached) and is closed.
LISTENER = r"""
import selectors, socket, sys
name, address, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
selector = selectors.DefaultSelector()
for port in ports:
    selector.register(socket.create_server((address, int(port)), backlog=128), selectors.EVENT_READ, port)
print("ready", flush=True)
while True:
    for key, _ in selector.select():
        connection, _ = key.fileobj.accept()
        with connection:
            try:
                connection.settimeout(5)
                connection.sendall(f"{name}:{key.data}\n".encode())
            except OSError:
                pass
"""

# Tries probes (JSON: key, address, port, CONNECT target or null, greeting or null) in parallel,
# each within one deadline; prints {key: reached}. Reached: the greeting came back (through the
# proxy's tunnel when a CONNECT target is given, after an HTTP 200), or, with no greeting, the
# TCP connection was made.
PROBER = r"""
import concurrent.futures, json, socket, sys, time
timeout, probes = float(sys.argv[1]), json.loads(sys.argv[2])

def reached(address, port, tunnel_to, greeting):
    deadline = time.monotonic() + timeout
    def left():
        return max(0.01, deadline - time.monotonic())
    try:
        with socket.create_connection((address, port), timeout=left()) as s:
            reader = s.makefile("rb")
            if tunnel_to is not None:
                s.sendall(f"CONNECT {tunnel_to} HTTP/1.1\r\nHost: {tunnel_to}\r\n\r\n".encode())
                s.settimeout(left())
                if reader.readline().split()[1:2] != [b"200"]:
                    return False
                while reader.readline() not in (b"\r\n", b""):
                    s.settimeout(left())
            if greeting is None:
                return True
            s.settimeout(left())
            return reader.readline().decode().strip() == greeting
    except (OSError, IndexError):
        return False

with concurrent.futures.ThreadPoolExecutor(len(probes)) as pool:
    results = pool.map(lambda probe: reached(*probe[1:]), probes)
    print(json.dumps(dict(zip([probe[0] for probe in probes], results))), flush=True)
"""

# Exits 0 once something accepts TCP connections at ADDRESS PORT, 1 if nothing does in time.
WAIT_ACCEPTING = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.05)
sys.exit(1)
"""


def wait_accepting(hosts, host: int, address: str, port: int, timeout: float) -> bool:
    """Whether ``address:port`` accepts a connection from inside ``host`` of ``hosts`` within ``timeout`` s."""
    waited = subprocess.run(hosts.command(host, [sys.executable, "-c", WAIT_ACCEPTING, address, port, timeout]),
                            capture_output=True, timeout=timeout + 5)
    return waited.returncode == 0


class Probe(NamedTuple):
    key: str                 # e.g. "site3->proxy->hub:8443"
    source: int              # host index it runs in
    target: int              # host index that must answer
    port: int
    via_proxy: bool
    expected: bool           # what the firewalls and the proxy must let happen


def read_line(process: subprocess.Popen, timeout: float) -> bytes:
    """The first line ``process`` writes, or b'' if none comes within ``timeout`` (never hangs)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    return process.stdout.readline() if ready else b""


def stop(process: subprocess.Popen, first: signal.Signals = signal.SIGKILL) -> None:
    """End ``process`` and its group (popen made it a session leader): ``first``, then SIGKILL
    if it has not gone within a second. Only while unreaped: then its pid is still its own."""
    for sig in dict.fromkeys((first, signal.SIGKILL)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
