"""The words of the ``%lab`` commands: value parsers and the argument parsers built from them.

``labkit.magics`` holds the commands; this module only turns words into values, with
one-line errors (``magic_args.CommandParser``) and one line of help per option
(``magic_help``), so the magics module stays a thin dispatch over ``Lab``.
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError

from labkit.magic_args import CommandParser
from labkit.magic_help import CELL_SUMMARY, command_parser
from labkit.network_magics import add_network_arguments
from labkit.strategies.catalog import CATALOG, settings_by_name
from labkit.units import parse_duration, positive_seconds, power_of_two_range


def seconds(text: str) -> float:
    try:
        return positive_seconds("a time limit", float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks are written 0,2,3; got {text!r}") from None


def name_values(text: str) -> dict:
    """``dim=128,layers=8`` -> {"dim": 128, "layers": 8} (integers where they are integers)."""
    settings = {}
    for word in text.replace(" ", ",").split(","):
        if not word:
            continue
        name, equals, value = word.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"write settings as name=value, got {word!r}")
        settings[name] = int(value) if value.lstrip("-").isdigit() else value
    return settings


def size_range(text: str) -> list[int]:
    """``1KB:16MB`` -> every power of two from 1 KiB to 16 MiB (see ``labkit.units``)."""
    try:
        return power_of_two_range(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def duration(text: str) -> float | None:
    """``30ms`` -> 0.03, ``0.5s`` or ``0.5`` -> 0.5, ``off`` -> None."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise UsageError(str(error)) from None


def split_run_words(words: list[str]) -> tuple[dict, list[str]]:
    """``%lab run``'s words -> ({option: value}, [script, its arguments ...]): options stand before the script."""
    options = {"--ranks": None, "--timeout": None}
    while words and words[0] in options:
        if len(words) < 2:
            raise UsageError(f"{words[0]} needs a value, e.g. %lab run --ranks 0,2 train.py")
        options[words[0]], words = words[1], words[2:]
    return options, words


def run_own_words(words: list[str]) -> list[str]:
    """The words of ``%lab run`` that are its own: its options and the word in the script's place."""
    _, script = split_run_words(words)
    return words[: len(words) - len(script) + 1]


def push_parser() -> CommandParser:
    """``%lab push NAME ...``: the names are looked up in the notebook by the magic."""
    push = command_parser("push")
    push.add_argument("names", nargs="+", metavar="NAME",
                      help="a function, class, module or value of the notebook; by source, by name or pickled")
    push.add_argument("--ranks", type=rank_list, metavar="0,2", help="push to these ranks only")
    return push


def train_parser():
    """``%lab train``'s options: only the ones given reach ``Lab.train``, whose defaults apply.

    Each strategy's own settings come from the catalog, so a new strategy brings its options."""
    train = command_parser("train", argument_default=argparse.SUPPRESS)
    train.add_argument("--strategy", metavar="S", help=f"{', '.join(CATALOG)} or a composition like fsdp+tp "
                                                       "(alone with --model: every one in turn)")
    train.add_argument("--model", choices=("mlp", "gpt"), help="the zoo model")
    train.add_argument("--steps", type=int, help="optimizer steps")
    train.add_argument("--resume", action="store_true", help="continue the last run from where it stopped")
    train.add_argument("--mesh", metavar="dp=2,tp=2", help="axis sizes for a composition")
    train.add_argument("--batch", type=int, dest="global_batch", help="global batch (samples per step)")
    train.add_argument("--micro-batches", type=int,
                       help="accumulation steps; pipeline microbatches (default: the stages under pp, else 1)")
    train.add_argument("--lr", type=float, help="learning rate")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), help="the optimizer")
    train.add_argument("--seed", type=int, help="the run's seed (initial weights and data)")
    train.add_argument("--max-memory", metavar="SIZE",
                       help="per-rank budget for params + grads + optimizer state, e.g. 64MB")
    train.add_argument("--verify", action="store_true", help="compare with single-process training")
    train.add_argument("--precision", choices=("fp32", "bf16"),
                       help="bf16: autocast (FSDP: its mixed-precision policy); fp32 keeps the equivalence proof")
    train.add_argument("--tf32", action="store_true", help="TensorFloat-32 matrix products on NVIDIA GPUs")
    train.add_argument("--peak-tflops", type=float, help="one device's peak TFLOP/s for MFU, where the lab has none")
    train.add_argument("--log-every", type=int, help="steps between progress lines")
    train.add_argument("--model-settings", type=name_values, metavar="dim=128,layers=8",
                       help="the model's own settings (see labkit.zoo)")
    train.add_argument("--timeout", type=seconds, metavar="S", help="limit for the run, seconds")
    train.add_argument("--dashboard", action="store_true",
                       help="draw it live and train in the background (Stop button; the cell returns the run)")
    train.add_argument("--straggler-threshold", type=float,
                       help="busy time against the median of like ranks that flags a straggler")
    for name, (owner, setting) in settings_by_name().items():
        said = setting.help if setting.help.lower().startswith(owner) else f"{owner}: {setting.help}"
        if setting.default is True:
            described = f"{said} (on unless this is given)"
        elif setting.default is False:
            described = said
        else:
            described = f"{said} (default {setting.default})"
        if isinstance(setting.default, bool):
            action = "store_false" if setting.default else "store_true"
            train.add_argument(setting.option, dest=name, action=action, help=described)
        else:
            train.add_argument(setting.option, dest=name, type=type(setting.default),
                               choices=setting.choices or None, help=described)
    return train


def build_parsers():
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
    train = train_parser()
    bench = command_parser("bench")
    bench.add_argument("operation", choices=("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                                             "reducescatter", "broadcast"), metavar="OPERATION",
                       help="allreduce, all_gather, reduce_scatter or broadcast")
    bench.add_argument("--sizes", type=size_range, metavar="1KB:16MB",
                       help="message sizes: the powers of two between")
    bench.add_argument("--iters", type=int, help="repetitions per size (default: more for small sizes)")
    cell = CommandParser(prog="%%lab", description=CELL_SUMMARY)
    cell.add_argument("--ranks", type=rank_list, metavar="0,2", help="run on these ranks only")
    cell.add_argument("--timeout", type=seconds, metavar="S", help="limit for this cell, seconds")
    return start, train, bench, cell
