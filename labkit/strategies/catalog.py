"""The strategy catalog: how a way of splitting the work is declared, and the ones this process knows.

A strategy is one module: its declaration, a ``Strategy`` named ``STRATEGY``,
beside its rank side, ``apply`` (``strategies.rank_side.StrategyModule``). The
built-ins are named below (``BUILT_IN``), in labkit's own code; a package of
yours names yours by an entry point of the ``labkit.strategies`` group
(``labkit.zoo.plugins``), found in the notebook and on every rank with no
call. A broken one breaks only itself (``strategy_notes`` says why, and what
to do). A declaration module loads without torch (its ``apply`` imports torch
when it runs, on the ranks), so the notebook reads every declaration.

A declaration says, without torch: its name, the mesh axis it uses, where it
is applied in a composition, its settings with their defaults and the
``%lab train`` option for each, how to check a run before any rank works, and
what the lab's generic code must know of it (whether it divides memory, gives
ranks roles, splits the batch its own way, keeps checkpoints, ...). Config
checks (``spec.train_config``), budget refusals (``runs.budget``), the magics'
options, the tests and the benchmarks all read these declarations; none of
them names a strategy.

``apply(composition, axis_mesh, config)`` changes ``composition``
(``strategies.compose.Composition``): it may shard or wrap the model, add a
gradient synchronisation to run after backward, wrap the optimizer step (a
context manager around ``optimizer.step()``, where DiLoCo's outer step or a
parameter server's push and pull go), or give ranks roles (for example
``server`` and ``worker``) with a loop of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib.metadata import EntryPoint
from itertools import combinations
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from labkit.zoo.plugins import PluginError, PluginGroup

if TYPE_CHECKING:
    from labkit.spec.train_config import TrainConfig

# Outermost first: tp innermost keeps its groups on neighbouring ranks; replicas that talk
# rarely (DiLoCo) outermost, so the ranks of one replica are neighbours.
AXIS_ORDER = ("replica", "pp", "dp", "tp")
DATA_AXES = ("replica", "dp")  # the global batch is split over these (unless a strategy says otherwise)

T = TypeVar("T")


class SettingValueError(ValueError):
    """A setting's value refused whatever the lab's size: the message says what to pass instead (so no
    other number of ranks is suggested for it)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting a strategy adds to ``lab.train`` (and to ``%lab train`` as ``flag``).

    Its value in a run is ``config.setting(SETTING)``, typed as its default is."""

    name: str
    default: T
    help: str
    choices: tuple[T, ...] = ()
    flag: str | None = None  # default: --name-with-dashes; a True default gets --no-... instead
    minimum: float | None = None  # numbers: the least value allowed (default: 1 for integers, above 0 for floats)
    below: float | None = None  # numbers: values must stay under this

    @property
    def option(self) -> str:
        if self.flag:
            return self.flag
        words = self.name.replace("_", "-")
        return f"--no-{words}" if self.default is True else f"--{words}"

    def check(self, value: object, strategy: str) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"unknown {self.name} {value!r} for {strategy}: choose "
                             f"{' or '.join(map(str, self.choices))}")
        if isinstance(self.default, bool) and not isinstance(value, bool):
            raise ValueError(f"{self.name} ({strategy}) is True or False, got {value!r}")
        if type(self.default) is int:
            least = 1 if self.minimum is None else self.minimum
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least == 1 else f"an integer of at least {least:g}"
                raise ValueError(f"{self.name} ({strategy}) is {kind}, got {value!r}")
        if isinstance(self.default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{self.name} ({strategy}) is a finite number, got {value!r}")
            if self.minimum is None and not value > 0:
                raise ValueError(f"{self.name} ({strategy}) is a positive number, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{self.name} ({strategy}) is at least {self.minimum:g}, got {value!r}")
        if self.below is not None and isinstance(value, (int, float)) and not value < self.below:
            raise ValueError(f"{self.name} ({strategy}) must be below {self.below:g}, got {value!r}")


@dataclass(frozen=True)
class Strategy:
    """One way of splitting the work; see the module docstring for the rank side."""

    name: str
    axis: str  # one of AXIS_ORDER
    order: int  # position when composed on a rank: lower first
    summary: str
    settings: tuple[Setting[Any], ...] = ()
    shards_memory: bool = False  # divides parameters, gradients and optimizer state over its axis
    # Torch-free checks of a resolved config using this strategy; raise ValueError with the reason.
    check: Callable[[TrainConfig], None] | None = None
    # Defaults that depend on the mesh (pipeline microbatches; a batch the ps workers divide), filled
    # before the checks for the general settings the user did not give: setting name -> value.
    defaults: Callable[[TrainConfig], dict[str, int]] | None = None
    # Each rank's role under this strategy, given the rank (None: every rank trains the same way).
    roles: Callable[[TrainConfig, int], str] | None = None
    # Into how many equal parts the global batch is split (None: the product of the data axes).
    data_parts: Callable[[TrainConfig], int] | None = None
    alone: bool = False  # runs by itself only, never in a composition (its ranks have roles of their own)
    no_checkpoints: str = ""  # why its training state cannot be checkpointed yet ("": it can)
    state_copies: int = 0  # copies of each rank's parameters it keeps beside the optimizer (memory estimate)
    # Only one rank along its axis computes the loss (a pipeline's last stage); else every rank of the
    # axis computes the same loss, and the first one prints the progress lines.
    loss_on_one_rank: bool = False
    over_budget: str = ""  # said when it alone exceeds the memory budget (why more ranks would not help)
    list_position: int = 100  # where it stands in lists and messages: lower first (then by name)
    # What it reads of a user's own model's options (``tp_plan``, ``pp_split``, ``fsdp_units``): an option that
    # no part of a run reads is refused, not silently dropped.
    model_options: tuple[str, ...] = ()
    # Its module, where ``apply`` is (default: the one its entry point names). Not part of what makes
    # two declarations the same: the one a module declares equals the one found through its entry point.
    module: str = field(default="", compare=False)

    @property
    def module_name(self) -> str:
        return self.module or f"labkit.strategies.{self.name}"


def _checked(entry: Strategy, point: EntryPoint) -> Strategy:
    """An installed declaration, checked, and told which module holds its ``apply``."""
    if entry.axis not in AXIS_ORDER:
        raise PluginError(f"strategy {entry.name!r} ({point.value}): axis {entry.axis!r} is not one of "
                          f"{', '.join(AXIS_ORDER)}")
    return entry if entry.module else replace(entry, module=point.module)


# labkit's own strategies: there wherever labkit is importable, with or without its package metadata.
BUILT_IN = {name: f"labkit.strategies.{name}:STRATEGY" for name in ("ddp", "fsdp", "tp", "pp", "ps", "diloco")}

# What is installed is the process's own: one reader per process, as ``importlib`` keeps one module table.
_STRATEGIES: PluginGroup[Strategy] = PluginGroup("labkit.strategies", "strategy", Strategy, built_in=BUILT_IN,
                                                 prepare=_checked)


def strategy(name: str) -> Strategy:
    """The declaration of strategy ``name`` (PluginError, a ValueError, naming the known ones if none, or
    saying why an installed one is not used)."""
    entry = _STRATEGIES.get(name)
    clash = _clashes().get(name)
    if clash is not None:
        raise PluginError(clash)
    return entry


def strategies() -> dict[str, Strategy]:
    """Every strategy this process can use, by name, in list order."""
    clashes = _clashes()
    return {name: entry for name, entry in _STRATEGIES.all().items() if name not in clashes}


def strategy_names() -> tuple[str, ...]:
    """The strategies this process can use, in list order (``strategy_notes``: the installed ones it cannot)."""
    return tuple(strategies())


def strategy_notes() -> tuple[str, ...]:
    """One line for each installed strategy that is not used: its error, and what to do."""
    return (*_STRATEGIES.notes(), *_clashes().values())


def _clashes() -> dict[str, str]:
    """Strategies left out because a setting of theirs is another's: name -> why, and what to do.

    The built-ins keep their settings; then the others, in list order, the first comer keeping a name."""
    owners: dict[str, str] = {}
    clashing: dict[str, str] = {}
    for entry in sorted(_STRATEGIES.all().values(), key=lambda entry: (entry.name not in BUILT_IN,
                                                                        entry.list_position, entry.name)):
        taken = sorted(setting.name for setting in entry.settings if owners.get(setting.name, entry.name) != entry.name)
        if taken:
            whose = ", ".join(f"{name} ({owners[name]}'s)" for name in taken)
            clashing[entry.name] = (f"the strategy {entry.name!r} has settings another strategy has: {whose}; "
                                    f"it is not used, the others work. To be rid of it: "
                                    f"{_STRATEGIES.remedy(entry.name)}")
            continue
        owners.update({setting.name: entry.name for setting in entry.settings})
    return clashing


class _Catalog(Mapping[str, Strategy]):
    """Every strategy by name, read-only, as ``strategies()`` finds them when asked."""

    def __getitem__(self, name: str) -> Strategy:
        if not isinstance(name, str) or not _STRATEGIES.knows(name):
            raise KeyError(name)
        return strategy(name)

    def __iter__(self) -> Iterator[str]:
        return iter(strategy_names())

    def __len__(self) -> int:
        return len(strategy_names())


CATALOG: Mapping[str, Strategy] = _Catalog()  # the catalog's older spelling: a view, it holds nothing itself


def register(entry: Strategy) -> None:
    """Use a strategy declared in a running notebook, in this process (a lesson, a first try).

    An installed package needs no call. One added this way must be added on the
    ranks too (``lab.run(register, entry)``), and its module (``module=__name__``)
    importable there; ``unregister`` forgets it."""
    if entry.axis not in AXIS_ORDER:
        raise ValueError(f"strategy {entry.name!r}: axis {entry.axis!r} is not one of {', '.join(AXIS_ORDER)}")
    if _STRATEGIES.knows(entry.name) and strategy(entry.name) != entry:
        raise ValueError(f"a different strategy is already called {entry.name!r}")
    taken = {name for name, (owner, _) in settings_by_name().items() if owner != entry.name}
    clashes = sorted(taken & {setting.name for setting in entry.settings})
    if clashes:
        raise ValueError(f"strategy {entry.name!r}: settings {', '.join(clashes)} belong to other strategies")
    _STRATEGIES.add(entry)


def unregister(name: str) -> None:
    """Forget a strategy ``register`` added in this process (an installed one stays: uninstall its package)."""
    _STRATEGIES.remove(name)


def refresh_strategies() -> None:
    """Read the installed packages again on the next question (after one was uninstalled)."""
    _STRATEGIES.refresh()


def parse_strategy(text: object) -> tuple[str, ...]:
    """``"fsdp+tp"`` -> ("fsdp", "tp"); unknown names, repeats and two parts on one axis are refused."""
    if not isinstance(text, str):
        raise ValueError(f"a strategy is a name such as 'ddp' or 'fsdp+tp', got {text!r}")
    parts = tuple(part.strip().lower() for part in text.split("+") if part.strip())
    unknown = [part for part in parts if not _STRATEGIES.knows(part)]
    if not parts or unknown:
        raise PluginError(f"unknown strategy {text!r}: use {', '.join(strategy_names())} or a composition such as "
                         f"fsdp+tp, ddp+pp, pp+tp.{_STRATEGIES.not_loading()} {_STRATEGIES.install_hint()}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"strategy {text!r} names a part twice")
    entries = [strategy(part) for part in parts]
    lonely = [entry for entry in entries if entry.alone]
    if lonely and len(parts) > 1:
        raise ValueError(f"{lonely[0].name} runs alone ({lonely[0].summary}): train with strategy "
                         f"{lonely[0].name!r}")
    for axis in {entry.axis for entry in entries}:
        sharing = [entry.name for entry in entries if entry.axis == axis]
        if len(sharing) > 1:
            raise ValueError(f"{' and '.join(sharing)} both use the {axis} axis: choose one of them")
    return parts


def axes_of(parts: tuple[str, ...] | list[str]) -> list[str]:
    """The mesh axes a composition needs, outermost first."""
    return sorted({strategy(part).axis for part in parts}, key=AXIS_ORDER.index)


def settings_by_name() -> dict[str, tuple[str, Setting[Any]]]:
    """Every strategy setting: name -> (owning strategy, setting); a strategy with a setting of another's name
    is left out (``strategy_notes`` says so)."""
    found: dict[str, tuple[str, Setting[Any]]] = {}
    for entry in strategies().values():  # a strategy whose setting another has is left out (``_clashes``)
        for setting in entry.settings:
            found[setting.name] = (entry.name, setting)
    return found


def sharding_alternatives() -> tuple[str, ...]:
    """Single strategies that divide memory: what a refused budget may suggest."""
    return tuple(name for name, entry in strategies().items() if entry.shards_memory)


def compositions(world_size: int) -> tuple[str, ...]:
    """Every strategy and composition a lab of ``world_size`` ranks can run: one part per axis, and
    at least 2 ranks on each axis (the tests and benchmarks run them all)."""
    known = strategies()
    found = []
    for count in range(1, len(AXIS_ORDER) + 1):
        if 2**count > world_size and count > 1:
            break
        for parts in combinations(known, count):
            if count > 1 and any(known[part].alone for part in parts):
                continue
            if len({known[part].axis for part in parts}) == count:
                found.append("+".join(sorted(parts, key=lambda part: (known[part].order != 2, part))))
    return tuple(found)


def checkpoint_refusal(parts: tuple[str, ...] | list[str]) -> str | None:
    """Why a run of these parts cannot save or load checkpoints, in words; None when it can."""
    for part in parts:
        if strategy(part).no_checkpoints:
            return f"{part} keeps no checkpoints yet: {strategy(part).no_checkpoints}"
    return None


def role_of(parts: tuple[str, ...] | list[str], config: TrainConfig, rank: int) -> str:
    """This rank's role in a composition: the first part that assigns roles decides; else 'trainer'."""
    for part in parts:
        entry = strategy(part)
        if entry.roles is not None:
            return entry.roles(config, rank)
    return "trainer"
