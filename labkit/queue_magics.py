"""``%lab tasks`` and ``%lab ensemble``: the work-stealing queue from a notebook line.

    %lab tasks FN ITEMS [--timeout S] [--retries N]
        FN(item) for every item of ITEMS, both names in the notebook (lab.tasks)
    %lab ensemble [--model gpt] [--members 4] [--steps 30] [--vary seed|lr] [--combine mean|vote]
        [--lr 0.003] [--seed 0]
        members trained apart on the queue, combined on held-out data (lab.ensemble)

Kept apart from ``labkit.magics`` so each module stays small; both only parse
and call the ``Lab``.
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError



class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _tasks_parser() -> _Parser:
    parser = _Parser(prog="%lab tasks", add_help=False)
    parser.add_argument("function", help="the name of a function in the notebook, called with each item")
    parser.add_argument("items", help="the name of a list (or any iterable) in the notebook")
    parser.add_argument("--timeout", type=float, help="limit for each task, seconds")
    parser.add_argument("--retries", type=int, help="how often a task may be requeued after its rank is lost")
    return parser


def _ensemble_parser() -> _Parser:
    from labkit.runs.ensemble import COMBINES, VARIES  # numpy, only when an ensemble is asked for

    parser = _Parser(prog="%lab ensemble", add_help=False)
    parser.add_argument("--model", default="gpt", choices=("gpt", "mlp"))
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vary", default="seed", choices=VARIES)
    parser.add_argument("--combine", default="mean", choices=COMBINES)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--timeout", type=float, help="limit for each member, seconds")
    return parser


def tasks_command(lab, words: list[str], namespace: dict):
    options = _tasks_parser().parse_args(words)
    missing = [name for name in (options.function, options.items) if name not in namespace]
    if missing:
        raise UsageError(f"%lab tasks takes names defined in the notebook; {', '.join(missing)} is not one")
    return lab.tasks(namespace[options.function], namespace[options.items], timeout=options.timeout,
                     retries=options.retries)


def ensemble_command(lab, words: list[str]):
    options = vars(_ensemble_parser().parse_args(words))
    settings = {name: options.pop(name) for name in ("lr", "seed", "timeout") if options[name] is not None}
    for name in ("lr", "seed", "timeout"):
        options.pop(name, None)
    return lab.ensemble(**options, **settings)
