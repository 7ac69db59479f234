"""One host's firewall for ``tests/netns_sites.py``, as an nftables or an iptables ruleset.

Every host drops by default what it receives (and, unless ``output_open``, what it sends), and
always lets through loopback and the packets of connections already made (replies, and ICMP
errors about them). ``HostRules`` adds the TCP it may also accept or open; both renderings say
the same, so the iptables one is the fallback where ``nft`` is missing::

    rules = HostRules(accept_out=[("198.18.0.1", 8443)])   # a site: only the hub's HTTPS port
    load_firewall(["ip", "netns", "exec", "NS"], rules, firewall_tool())
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.netns_hosts import NetnsError

TABLE = "labkit_sites"
LOAD_TIMEOUT = 10.0


@dataclass
class HostRules:
    accept_in: list[tuple[str | None, int]] = field(default_factory=list)   # (from address or any, to port)
    accept_out: list[tuple[str, int]] = field(default_factory=list)         # (to address, to port)
    output_open: bool = False                                               # may send anything


def firewall_tool() -> str | None:
    """'nft' where nftables is installed, else 'iptables' where iptables-restore is, else None."""
    if shutil.which("nft"):
        return "nft"
    if shutil.which("iptables-restore") and shutil.which("ip6tables-restore"):
        return "iptables"
    return None


def nft_ruleset(rules: HostRules) -> str:
    # An inet table covers IPv4 and IPv6 alike: the veth ends' link-local IPv6 addresses would
    # otherwise be a way between hosts that no IPv4 rule sees.
    accept_in = [f"{f'ip saddr {source} ' if source else ''}tcp dport {port} accept"
                 for source, port in rules.accept_in]
    accept_out = [f"ip daddr {address} tcp dport {port} accept" for address, port in rules.accept_out]
    output_policy = "accept" if rules.output_open else "drop"

    def chain(name: str, hook: str, policy: str, loopback: str, accepted: list[str]) -> str:
        lines = [f"type filter hook {hook} priority 0; policy {policy};", loopback,
                 "ct state established,related accept", *accepted]
        return f"  chain {name} {{\n" + "".join(f"    {line}\n" for line in lines) + "  }\n"

    # "add + delete" first, so loading it again replaces the table instead of failing.
    return (f"table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n"
            + chain("input", "input", "drop", "iif lo accept", accept_in)
            + chain("output", "output", output_policy, "oif lo accept", accept_out) + "}\n")


def iptables_ruleset(rules: HostRules, ipv6: bool = False) -> str:
    """iptables-restore input; for ``ipv6`` the same policies with no address rules (all our
    addresses are IPv4), so IPv6 carries nothing but loopback and, from an open host, its own."""
    lines = ["*filter", ":INPUT DROP [0:0]", ":FORWARD DROP [0:0]",
             f":OUTPUT {'ACCEPT' if rules.output_open else 'DROP'} [0:0]",
             "-A INPUT -i lo -j ACCEPT", "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
             "-A OUTPUT -o lo -j ACCEPT", "-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
    if not ipv6:
        lines += [f"-A INPUT -p tcp{f' -s {source}' if source else ''} --dport {port} -j ACCEPT"
                  for source, port in rules.accept_in]
        lines += [f"-A OUTPUT -p tcp -d {address} --dport {port} -j ACCEPT" for address, port in rules.accept_out]
    return "\n".join([*lines, "COMMIT", ""])


def load_firewall(prefix: list[str], rules: HostRules, tool: str | None, path: Path | None = None) -> None:
    """Load ``rules`` with ``tool`` ('nft' or 'iptables'), each command run after ``prefix`` (e.g.
    `ip netns exec NS`). The ruleset is written to ``path`` (kept, for a look after a failure),
    or to a temporary file."""
    if tool not in ("nft", "iptables"):
        raise NetnsError(f"no firewall tool to load rules with (got {tool!r}): install nftables or iptables")
    with tempfile.TemporaryDirectory() as scratch:
        path = path or Path(scratch) / "rules"
        if tool == "nft":
            loads = [(path, nft_ruleset(rules), ["nft", "-f"])]
        else:
            v6 = path.with_name(path.name + ".v6")
            loads = [(path, iptables_ruleset(rules), ["iptables-restore"]),
                     (v6, iptables_ruleset(rules, ipv6=True), ["ip6tables-restore"])]
        for file, text, command in loads:
            file.write_text(text)
            argv = [*prefix, *command, str(file)]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=LOAD_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise NetnsError(f"`{' '.join(argv)}`: {error}") from None
            if done.returncode != 0:
                raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
