"""``%lab start`` options for labs past one machine, and ``%lab join-command``.

    %lab start 4 --launcher mpi --launcher-option mpi_args='["-hosts", "a,b"]'
    %lab start 2 --controller-address 10.0.0.5 [--interface eth1] [--ranks-per-host 8] [--encrypt]
    %lab join-command      the one line that makes another machine's engine join this lab
"""

from __future__ import annotations

import argparse
import ast
from typing import TYPE_CHECKING, Any

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


def join_command_line(lab: Lab) -> None:
    """Print the join command, and what it does."""
    from labkit.cluster.join import reach_note

    print(lab.join_command())
    print("Run it on another machine with labkit installed: its engine connects out to this lab and becomes "
          "the next rank at the next %lab start or %lab heal. It carries the lab's key: share it like a password.")
    note = reach_note(lab.cluster)
    if note:
        print(f"Note: {note}.")
