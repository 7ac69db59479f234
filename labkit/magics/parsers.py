"""The parsers of the commands whose options argparse reads: ``%lab start``, ``bench``, ``push``, ``who``
and ``%%lab``.

``%lab train``'s is in ``train_args`` (its options come from the catalog), those
of ``%lab tasks`` and ``%lab ensemble`` beside their commands in ``queue``; all
are made by ``parsing.command_parser``.
"""

from __future__ import annotations

import argparse

from labkit.magics.auto import AUTO_FLAG
from labkit.magics.commands import CELL
from labkit.magics.network import add_network_arguments
from labkit.magics.parsing import CommandParser, command_parser
from labkit.magics.values import bounded_count, rank_list, seconds, size_range
from labkit.spec.bounds import MAX_BENCH_ITERATIONS, check_whole

OPERATIONS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "reducescatter", "broadcast")


def start_parser() -> CommandParser:
    start = command_parser("start")
    start.add_argument("ranks", nargs="?", type=int, default=4, metavar="N", help="number of ranks (default 4)")
    start.add_argument("--backend", choices=("gloo", "nccl"),
                       help="default nccl when GPUs are visible (one rank per GPU), else gloo")
    start.add_argument("--timeout", type=seconds, metavar="S", help="default limit for each cell, seconds")
    start.add_argument("--start-timeout", type=seconds, metavar="S", help="limit for the ranks to come up, seconds")
    start.add_argument("--threads", type=int, help="torch threads per rank (default: cores // ranks)")
    start.add_argument("--check-collectives", action="store_true",
                       help="compare every collective across ranks first; a mismatch names each rank's call")
    start.add_argument("--oversubscribe", action="store_true",
                       help="start more ranks than this machine's memory and cores are judged to hold")
    add_network_arguments(start)
    return start


def bench_parser() -> CommandParser:
    bench = command_parser("bench")
    bench.add_argument("operation", choices=OPERATIONS, metavar="OPERATION",
                       help="allreduce, all_gather, reduce_scatter or broadcast")
    bench.add_argument("--sizes", type=size_range, metavar="1KB:16MB", help="message sizes: the powers of two between")
    iterations = bounded_count(lambda value: check_whole("a repetition count", value, MAX_BENCH_ITERATIONS,
                                                         "--iters 20"))
    bench.add_argument("--iters", type=iterations, metavar="N",
                       help=f"repetitions per size, 1 to {MAX_BENCH_ITERATIONS:,} (default: more for small sizes)")
    return bench


def push_parser() -> CommandParser:
    """``%lab push NAME ...``: the names are looked up in the notebook by the magic."""
    push = command_parser("push")
    push.add_argument("names", nargs="+", metavar="NAME",
                      help="a function, class, module or value of the notebook; by source, by name or pickled")
    push.add_argument("--ranks", type=rank_list, metavar="0,2", help="push to these ranks only")
    return push


def cell_parser() -> CommandParser:
    """``%%lab [--ranks 0,2] [--site NAME] [--timeout S] [--instruments] [--dashboard] [--background]
    [--view tabs|grid]``: the cell magic's line."""
    cell = command_parser(CELL)
    cell.add_argument("--ranks", type=rank_list, metavar="0,2", help="run on these ranks only")
    cell.add_argument("--site", metavar="NAME", help="on the ranks of this site (a machine that joined over HTTPS)")
    cell.add_argument("--timeout", type=seconds, metavar="S", help="limit for this cell, seconds")
    cell.add_argument("--instruments", action="store_true", help="watch the cell's loop: its report is the value")
    cell.add_argument("--dashboard", action="store_true", help="draw the cell's loop live (instruments on)")
    cell.add_argument("--background", action="store_true", help="return at once; .stop() ends it at a step")
    cell.add_argument("--view", choices=("tabs", "grid"),
                      help="each rank's output on a page of its own: tabs, or a grid of columns")
    cell.add_argument(AUTO_FLAG, action="store_true", help=argparse.SUPPRESS)  # a cell %lab auto sent to the ranks
    return cell


def who_parser() -> CommandParser:
    """``%lab who [--ranks 0,2]``."""
    who = command_parser("who")
    who.add_argument("--ranks", type=rank_list, metavar="0,2", help="list the variables of these ranks only")
    return who
