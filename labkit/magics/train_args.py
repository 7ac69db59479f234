"""``%lab train``'s options: the settings of ``Lab.train``, and each strategy's own from the catalog.

Only the options given reach ``Lab.train`` (``argparse.SUPPRESS`` as the
default), so its defaults apply; a new strategy brings its options with its
catalog entry, with no change here.
"""

from __future__ import annotations

import argparse
import difflib

from labkit.magics.parsing import CommandParser, command_parser
from labkit.magics.values import name_values, seconds
from labkit.spec.train_checks import ON_NONFINITE
from labkit.strategies.catalog import settings_by_name, strategy_names, strategy_notes
from labkit.zoo.catalog import model_names, model_notes


def train_parser() -> CommandParser:
    """``%lab train``'s parser: the lab's settings, then each strategy's own, one option each."""
    train = command_parser("train", argument_default=argparse.SUPPRESS, epilog=_plugin_notes())
    train.add_argument("--strategy", metavar="S", help=f"{', '.join(strategy_names())} or a composition like fsdp+tp "
                                                       "(alone with --model: every one in turn)")
    train.add_argument("--model", metavar="NAME",
                       help=f"{', '.join(model_names())} (the zoo's or an installed plugin's), or the name of your own "
                            "model class (or function returning one) in the notebook")
    train.add_argument("--data", metavar="NAME", help="your own model's data: a Dataset or a function "
                                                      "(step, generator) -> batch in the notebook, by name")
    train.add_argument("--loss", metavar="NAME", help="your own model's loss: a function (output, batch) -> "
                                                      "scalar in the notebook, by name (default: cross-entropy)")
    train.add_argument("--tp-plan", metavar="NAME", help="your own model's tensor-parallel plan: a dict in the "
                                                         "notebook, by name")
    train.add_argument("--pp-split", type=_names, metavar="blocks.4,blocks.8",
                       help="your own model: the modules where each pipeline stage after the first starts")
    train.add_argument("--fsdp-units", type=_names, metavar="Block",
                       help="your own model: the classes FSDP shards as units of their own")
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
    train.add_argument("--on-nonfinite", choices=ON_NONFINITE,
                       help="a step whose loss is NaN or infinite: stop the run (default), skip its update, "
                            "or continue")
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
    _add_strategy_settings(train)
    return train


def _plugin_notes() -> str:
    """The installed strategies and models that are not used, each with its error and what to do ('' if none)."""
    notes = [*strategy_notes(), *model_notes()]
    return "\n".join(["Installed but not used:", *(f"  {note}" for note in notes)]) if notes else ""


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def notebook_values(options: dict, namespace: dict) -> dict:
    """``--model``, ``--data``, ``--loss`` and ``--tp-plan`` as the notebook's values they name (a catalog
    model's name stays a name); an unknown name refused, saying what is known."""
    resolved = dict(options)
    for option in ("model", "data", "loss", "tp_plan"):
        name = options.get(option)
        if name is None or (option == "model" and name in model_names()):
            continue
        if name not in namespace:
            zoo = list(model_names()) if option == "model" else []
            known = f"the zoo's {' or '.join(zoo)}, or " if zoo else ""
            close = difflib.get_close_matches(name, zoo + [key for key in namespace if not key.startswith("_")], n=1)
            meant = f"did you mean {close[0]!r}? " if close else ""
            flag = option.replace("_", "-")
            raise ValueError(f"--{flag}: the notebook has no {name!r}; {meant}give {known}a name the notebook "
                             f"defines (see %lab train --help)")
        resolved[option] = namespace[name]
    return resolved


def _add_strategy_settings(train: CommandParser) -> None:
    """One option per strategy setting of the catalog, its help saying whose it is and its default."""
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
