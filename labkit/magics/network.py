"""``%lab start`` options for labs past one machine, and ``%lab join-command``.

    %lab start 4 --launcher mpi --launcher-option mpi_args='["-hosts", "a,b"]'
    %lab start 2 --controller-address 10.0.0.5 [--interface eth1] [--ranks-per-host 8] [--encrypt]
    %lab join-command      the one line that makes another machine's engine join this lab
    %lab join-command --https [--port 8443] [--address A] [--url wss://...] [--ranks N] [--expires 1h]
                           the one line that makes a machine behind NAT a site, over one HTTPS line
"""

from __future__ import annotations

import argparse
import ast
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

if TYPE_CHECKING:
    from labkit.lab import Lab

NETWORK_SETTINGS = ("controller_address", "interface", "ranks_per_host")  # Lab arguments passed only when given


def launcher_option(text: str) -> tuple[str, object]:
    """KEY=VALUE; the value as a Python literal (a list, a number, a dict) or else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. mpi_args='[\"-n\", \"2\"]', got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed


def add_network_arguments(start: argparse.ArgumentParser) -> None:
    start.add_argument("--launcher", default="hosted", metavar="NAME",
                       help="ipyparallel engine launcher: hosted (the lab's own), mpi, ssh, slurm, ...")
    start.add_argument("--launcher-option", type=launcher_option, action="append", default=[],
                       dest="launcher_options", metavar="KEY=VALUE", help="an option of the launcher (repeatable)")
    start.add_argument("--controller-address", metavar="A",
                       help="this machine's address that other hosts reach (default: loopback, one machine)")
    start.add_argument("--interface", metavar="I", help="network interface for gloo/nccl on every rank")
    start.add_argument("--ranks-per-host", type=int, metavar="K", help="ranks a host may hold (nccl: its GPUs)")
    start.add_argument("--encrypt", action="store_true", help="CurveZMQ encryption on every ipyparallel socket")


def network_settings(options: argparse.Namespace) -> dict[str, Any]:
    """The ``Lab`` arguments the network options ask for (only those given, so defaults stay the Lab's)."""
    settings: dict[str, Any] = dict(options.launcher_options)
    settings["launcher"] = options.launcher
    for name in NETWORK_SETTINGS:
        if getattr(options, name) is not None:
            settings[name] = getattr(options, name)
    if options.encrypt:
        settings["encrypt"] = True
    return settings


def span(text: str) -> str:
    """``--expires``: a span of time as ``labkit.units.parse_seconds`` reads it (1h, 30m, 90s, 3600), kept as
    written."""
    from labkit.units import parse_seconds

    try:
        parse_seconds("--expires", text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a span of time above zero and at most 7 days, such as 1h, 30m "
                                         f"or 90s; got {text!r}") from None
    return text


def join_parser():
    from labkit.magics.parsing import command_parser

    join = command_parser("join-command")
    join.add_argument("--https", action="store_true", help="a site over one outbound HTTPS line (behind NAT)")
    join.add_argument("--address", metavar="A", help="--https: where the line listens (default: every interface)")
    join.add_argument("--port", type=int, metavar="P", help="--https: its port (default 8443; 0: any free one)")
    join.add_argument("--url", metavar="wss://HOST:PORT/labkit/line", help="--https: what sites dial, if not that")
    join.add_argument("--certfile", metavar="PEM", help="--https: a certificate of your own (with --keyfile)")
    join.add_argument("--keyfile", metavar="PEM", help="--https: its private key")
    join.add_argument("--ranks", type=int, metavar="N", help="--https: ranks the site runs (default: its GPUs, or 1)")
    join.add_argument("--expires", default="1h", type=span, metavar="SPAN",
                      help="--https: new sites admitted for (1h, 30m)")
    return join


def join_command_line(lab: Lab, options: argparse.Namespace) -> None:
    """Print the join command, and what it does."""
    from labkit.cluster.join import reach_note

    if options.https:
        print(lab.join_command(https=True, address=options.address, port=options.port, url=options.url,
                               certfile=options.certfile, keyfile=options.keyfile, expires=options.expires,
                               ranks=options.ranks))
        print("Run it on a machine with labkit installed, behind any NAT or firewall that lets HTTPS out (it honours "
              "HTTPS_PROXY): it becomes a site with ranks of its own, lab.site(NAME) (or %%lab --site NAME). "
              "Whoever holds it can run code in the lab until it expires: share it like a password.")
        return
    https_only = [name for name in ("address", "port", "url", "certfile", "keyfile", "ranks")
                  if getattr(options, name) is not None]
    if https_only:
        raise UsageError(f"--{https_only[0]} is for a site that joins over HTTPS: add --https")
    print(lab.join_command())
    print("Run it on another machine with labkit installed: its engine connects out to this lab and becomes "
          "the next rank at the next %lab start or %lab heal. It carries the lab's key: share it like a password.")
    note = reach_note(lab.cluster)
    if note:
        print(f"Note: {note}.")
