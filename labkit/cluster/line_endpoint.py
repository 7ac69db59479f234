"""A lab's HTTPS line endpoint: the hub on one port, its certificate, and the join tokens it accepts.

``open_line(cluster, ...)`` starts a ``line.hub_server.LineHub`` for a running ``RankCluster``: it
listens on ``address:port`` (all of this machine's interfaces by default, since the machines that
join are elsewhere; TLS and the token guard it), lets sites' streams reach the controller's ports
(on the controller's own address, loopback by default) and the outer sync, and tells each site
what its engines need (the controller's connection info: whoever has a token can run code in the
lab). Without ``certfile``/``keyfile`` the lab makes its own certificate in its private folder and
every token pins it. ``LineEndpoint.join_command`` prints the one line a machine runs to join.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass

from labkit.cluster.rank_cluster import HEARTBEAT_MS
from labkit.line import token as tokens
from labkit.line.hub_server import LineHub
from labkit.line.targets import SYNC, port_targets
from labkit.line.tls import fingerprint, make_certificate
from labkit.spec.errors import LabConfigError
from labkit.spec.network import check_ipv4, ipv4_addresses
from labkit.units import positive_seconds

DEFAULT_PORT = 8443
ANY_ADDRESS = "0.0.0.0"
HEARTBEAT_MISSES = 10  # ipyparallel's HeartMonitor.max_heartmonitor_misses, which the lab leaves as it is
# A site ends its engines when it has heard nothing for this long: the controller drops an engine after
# HEARTBEAT_MISSES missed beats, so by then its engines are as good as gone (margin for the line's delay).
STALE_SECONDS = 0.7 * HEARTBEAT_MISSES * HEARTBEAT_MS / 1000
DEFAULT_EXPIRY = 3600.0


@dataclass
class LineEndpoint:
    hub: LineHub
    url: str
    lab: str
    secret: str
    pin: str | None

    def token(self, expires_in: float = DEFAULT_EXPIRY) -> tokens.LineToken:
        """A token that admits new sites for ``expires_in`` seconds (sites that joined keep their line)."""
        expires = time.time() + positive_seconds("expires", expires_in)
        self.hub.expires = max(self.hub.expires, expires)
        return tokens.LineToken(self.url, self.lab, self.secret, expires, self.pin)

    def join_command(self, expires_in: float = DEFAULT_EXPIRY, python: str = "python", ranks: int | None = None) -> str:
        extra = f" --ranks {ranks}" if ranks is not None else ""
        return f"{python} -m labkit join {self.token(expires_in).encode()}{extra}"

    def close(self) -> None:
        self.hub.stop()


def _dialled_host(address: str) -> str:
    """The host a site dials when the hub listens on ``address``: that address, or this machine's first
    address that is not loopback (sites elsewhere cannot dial 127.0.0.1), or its name."""
    if address != ANY_ADDRESS:
        return address
    found = [a for held in ipv4_addresses().values() for a in held if not a.startswith("127.")]
    return found[0] if found else socket.gethostname()


def open_line(cluster, address: str = ANY_ADDRESS, port: int = DEFAULT_PORT, url: str | None = None,
              certfile: str | None = None, keyfile: str | None = None) -> LineEndpoint:
    """Start the hub of ``cluster``'s lab (checked first: nothing listens until every argument is good)."""
    address = check_ipv4(address, "address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise LabConfigError(f"port is a TCP port number (0-65535; 0: any free port), got {port!r}")
    if (certfile is None) != (keyfile is None):
        raise LabConfigError("give certfile and keyfile together (a PEM certificate and its private key), or "
                             "neither (the lab makes its own certificate and the join command pins it)")
    if url is not None and not (isinstance(url, str) and url.startswith("wss://")):
        raise LabConfigError(f"url is the address sites dial, 'wss://host:port{tokens.PATH}', got {url!r}")
    host = _dialled_host(address)
    pin = None
    if certfile is None:
        names = [host, socket.gethostname(), *(a for held in ipv4_addresses().values() for a in held)]
        certfile, keyfile = make_certificate(cluster.workdir, names)
        pin = fingerprint(certfile)
    assert keyfile is not None, "given with certfile, or made with it"
    connection = cluster.engine_connection()
    controller = cluster.plan.controller_address
    targets = {name: (controller, number) for name, number in port_targets(connection).items()}
    welcome = {"connection": connection, "targets": [*targets, SYNC], "stale_seconds": STALE_SECONDS}
    lab = secrets.token_hex(8)
    hub = LineHub(address, port, secrets.token_hex(32), lab, certfile, keyfile, targets, welcome).start()
    dialled = url or f"wss://{host}:{hub.port}{tokens.PATH}"
    return LineEndpoint(hub, dialled, lab, hub.secret, pin)
