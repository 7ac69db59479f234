"""Which of the controller's ports a site's engines reach through the line, and under which names.

ipyparallel's engine connection info names the controller's ports (``registration``, ``mux``,
``hb_ping``, ... and a list, ``broadcast``). A site's engines get the same info with every port
replaced by the local end of the line that carries it (``local_connection``), so a stock
ipyparallel engine runs unchanged: it connects to ``tcp://127.0.0.1:<local port>`` and the line
does the rest. ``SYNC`` is one more target, the outer sync of a DiLoCo run across sites.
"""

from __future__ import annotations

SYNC = "sync"
LOOPBACK = "127.0.0.1"


def port_targets(connection: dict) -> dict[str, int]:
    """Target name -> controller port, for every port in ``connection`` (lists as name0, name1, ...)."""
    targets = {}
    for key, value in connection.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            targets[key] = value
        elif isinstance(value, list) and all(isinstance(port, int) and not isinstance(port, bool) for port in value):
            targets.update({f"{key}{index}": port for index, port in enumerate(value)})
    return targets


def local_connection(connection: dict, local_ports: dict[str, int]) -> dict:
    """``connection`` with the controller reached at this machine's local ends of the line."""
    local = dict(connection, interface=f"tcp://{LOOPBACK}", location=LOOPBACK)
    for key, value in connection.items():
        if isinstance(value, int) and not isinstance(value, bool) and key in local_ports:
            local[key] = local_ports[key]
        elif isinstance(value, list) and f"{key}0" in local_ports:
            local[key] = [local_ports[f"{key}{index}"] for index in range(len(value))]
    local.pop("ssh", None)
    return local
