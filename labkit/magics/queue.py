"""``%lab tasks`` and ``%lab ensemble``: the work-stealing queue from a notebook line.

    %lab tasks FN ITEMS [--timeout S] [--retries N]
        FN(item) for every item of ITEMS, both names in the notebook (lab.tasks)
    %lab ensemble [--model gpt] [--members 4] [--steps 30] [--vary seed|lr] [--combine mean|vote]
        [--lr 0.003] [--seed 0]
        members trained apart on the queue, combined on held-out data (lab.ensemble)

Both read their words before the lab is asked for (``require_lab``), so a
mistake is answered whether a lab runs or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from labkit.magics.parsing import CommandParser, command_parser
from labkit.magics.values import seconds
from labkit.zoo.catalog import model_names

if TYPE_CHECKING:
    from labkit.lab import Lab

ENSEMBLE_SETTINGS = ("lr", "seed", "timeout")  # passed only when given, so the defaults stay lab.ensemble's


def tasks_parser() -> CommandParser:
    parser = command_parser("tasks")
    parser.add_argument("function", metavar="FN", help="the name of a function in the notebook, called with each item")
    parser.add_argument("items", metavar="ITEMS", help="the name of a list (or any iterable) in the notebook")
    parser.add_argument("--timeout", type=seconds, metavar="S", help="limit for each task, seconds")
    parser.add_argument("--retries", type=int, help="how often a task may be requeued after its rank is lost")
    return parser


def ensemble_parser() -> CommandParser:
    from labkit.runs.ensemble import COMBINES, VARIES  # numpy, only when an ensemble is asked for

    parser = command_parser("ensemble")
    parser.add_argument("--model", default="gpt", choices=model_names(), help="the model (default gpt)")
    parser.add_argument("--members", type=int, default=4, help="members trained apart (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="steps each member trains (default 30)")
    parser.add_argument("--vary", default="seed", choices=VARIES,
                        help="what differs between members: initial weights or learning rate (default seed)")
    parser.add_argument("--combine", default="mean", choices=COMBINES,
                        help="averaged probabilities or a vote (default mean)")
    parser.add_argument("--lr", type=float, help="learning rate (with --vary lr: the middle of the spread)")
    parser.add_argument("--seed", type=int, help="the first member's seed (under --vary seed member i takes seed + i)")
    parser.add_argument("--timeout", type=seconds, metavar="S", help="limit for each member, seconds")
    return parser


def tasks_command(require_lab: Callable[[], Lab], words: list[str], namespace: dict[str, Any]) -> Any:
    """``require_lab()`` gives the running lab (or says how to start one), asked once the words are read."""
    options = tasks_parser().parse_args(words)
    lab = require_lab()
    missing = [name for name in (options.function, options.items) if name not in namespace]
    if missing:
        raise UsageError(f"%lab tasks takes names defined in the notebook; {', '.join(missing)} is not one")
    return lab.tasks(namespace[options.function], namespace[options.items], timeout=options.timeout,
                     retries=options.retries)


def ensemble_command(require_lab: Callable[[], Lab], words: list[str]) -> Any:
    options = vars(ensemble_parser().parse_args(words))
    lab = require_lab()
    settings = {name: options.pop(name) for name in ENSEMBLE_SETTINGS if options[name] is not None}
    for name in ENSEMBLE_SETTINGS:
        options.pop(name, None)
    return lab.ensemble(**options, **settings)
