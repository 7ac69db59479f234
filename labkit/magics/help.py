"""What ``%lab --help`` and ``%lab COMMAND --help`` show for what no option parser reads.

``%lab --help`` lists every command in one line (``commands.SUMMARIES``). The
commands whose few words are read by hand (``%lab kill 1``, ``%lab link 100Mbit
20ms``) get a parser here that only describes them, for their ``--help``.
"""

from __future__ import annotations

from labkit.magics.commands import CELL, CELL_SUMMARY, SUMMARIES
from labkit.magics.parsing import CommandParser, command_parser

BARE = ("heal", "sites", "status", "restart", "stop")  # commands that take no words


def described_parsers() -> dict[str, CommandParser]:
    """Parsers that only describe the commands read by hand (for their ``--help``)."""
    mesh = command_parser("mesh", usage="%lab mesh NAME=SIZE [NAME=SIZE ...]")
    mesh.add_argument("sizes", metavar="NAME=SIZE", help="an axis and its size, e.g. dp=2 tp=2; one size may be -1")
    slow = command_parser("slow", usage="%lab slow RANK DELAY")
    slow.add_argument("rank", metavar="RANK", help="the rank to slow down")
    slow.add_argument("delay", metavar="DELAY", help="added to each of its steps, e.g. 30ms; off: its own speed again")
    link = command_parser("link", usage="%lab link [BANDWIDTH] [LATENCY] | %lab link off | %lab link")
    link.add_argument("bandwidth", metavar="BANDWIDTH", help="e.g. 100Mbit or 1Gbit/s (left out: unlimited)")
    link.add_argument("latency", metavar="LATENCY", help="per message round, e.g. 20ms (left out: none)")
    link.add_argument("off", metavar="off", help="remove the link: collectives run at this machine's speed")
    seed = command_parser("seed", usage="%lab seed S [--same]")
    seed.add_argument("seed", metavar="S", help="a non-negative integer; rank r gets S + r")
    seed.add_argument("--same", action="store_true", help="S on every rank")
    run = command_parser("run", usage="%lab run [--ranks 0,2] [--timeout S] [--instruments] [--dashboard] "
                                      "[--background] SCRIPT [ARGS ...]")
    run.add_argument("--ranks", metavar="0,2", help="run on these ranks only (options stand before the script)")
    run.add_argument("--timeout", metavar="S", help="limit for the script, seconds")
    run.add_argument("--instruments", action="store_true", help="watch its loop: steps, samples, collectives")
    run.add_argument("--dashboard", action="store_true", help="draw its loop live (instruments on)")
    run.add_argument("--background", action="store_true", help="return at once; .stop() ends it at a step")
    run.add_argument("script", metavar="SCRIPT", help="the script's path, as torchrun takes it")
    run.add_argument("args", metavar="ARGS", help="the script's own arguments (its --help is its own)")
    checkpoint = command_parser("checkpoint", usage="%lab checkpoint save PATH | %lab checkpoint load PATH")
    checkpoint.add_argument("save", metavar="save PATH", help="save the ranks' training state to PATH")
    checkpoint.add_argument("load", metavar="load PATH",
                            help="load PATH (or the newest checkpoint in a checkpoint_dir), resharded to these ranks")
    kill = command_parser("kill", usage="%lab kill RANK")
    kill.add_argument("rank", metavar="RANK", help="the rank to kill")
    debug = command_parser("debug", usage="%lab debug [RANK]")
    debug.add_argument("rank", metavar="RANK", help="the rank whose last exception to open (default: the first "
                                                    "rank that raised in the last failed work)")
    timeout = command_parser("timeout", usage="%lab timeout S")
    timeout.add_argument("seconds", metavar="S", help="seconds a cell may run before its ranks are interrupted")
    auto = command_parser("auto", usage="%lab auto [on|off]")
    auto.add_argument("on", metavar="on", help="(or nothing) every following cell runs on the ranks, as %%%%lab")
    auto.add_argument("off", metavar="off", help="cells run in the notebook again")
    bare = {name: command_parser(name, usage=f"%lab {name}") for name in BARE}
    return dict(mesh=mesh, slow=slow, link=link, seed=seed, run=run, checkpoint=checkpoint, kill=kill,
                timeout=timeout, auto=auto, debug=debug, **bare)


def overview() -> str:
    """``%lab --help``: every command in one line."""
    width = max(map(len, SUMMARIES))
    lines = ["%lab COMMAND [options]: live torch.distributed ranks; %lab COMMAND --help for its options"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, summary in SUMMARIES.items()]
    lines.append(f"{CELL} [options]: {CELL_SUMMARY}")
    return "\n".join(lines) + "\n"
