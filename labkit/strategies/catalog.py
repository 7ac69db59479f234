"""The strategy catalog: the one place where a way of splitting the work is declared.

Each entry says, without torch: its name, the mesh axis it uses, where it is
applied in a composition, its settings with their defaults and the
``%lab train`` option for each, how to check a run before any rank works, and
whether it divides memory (so a refused memory budget may suggest it). Config
checks (``spec.train_config``), budget refusals (``runs.budget``), the magics'
options, the tests and the benchmarks all read this table.

The rank side of an entry is its module (``labkit.strategies.<name>``), loaded
on the ranks only, with one function::

    apply(composition, axis_mesh, config) -> None

It changes ``composition`` (``strategies.compose.Composition``): it may shard or
wrap the model, add a gradient synchronisation to run after backward, wrap the
optimizer step (a context manager around ``optimizer.step()``, where DiLoCo's
outer step or a parameter server's push and pull go), or give ranks roles (for
example ``server`` and ``worker``) with a loop of their own. A new strategy is
its module plus one ``Strategy`` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# Outermost first: tp innermost keeps its groups on neighbouring ranks; replicas that talk
# rarely (DiLoCo) outermost, so the ranks of one replica are neighbours.
AXIS_ORDER = ("replica", "pp", "dp", "tp")
DATA_AXES = ("replica", "dp")  # the global batch is split over these (unless a strategy says otherwise)


@dataclass(frozen=True)
class Setting:
    """One setting a strategy adds to ``lab.train`` (and to ``%lab train`` as ``flag``)."""

    name: str
    default: Any
    help: str
    choices: tuple = ()
    flag: str | None = None  # default: --name-with-dashes; a True default gets --no-... instead
    minimum: float | None = None  # numbers: the least value allowed (default: 1 for integers, above 0 for floats)
    below: float | None = None  # numbers: values must stay under this

    @property
    def option(self) -> str:
        if self.flag:
            return self.flag
        words = self.name.replace("_", "-")
        return f"--no-{words}" if self.default is True else f"--{words}"

    def check(self, value, strategy: str) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"unknown {self.name} {value!r} for {strategy}: choose {' or '.join(self.choices)}")
        if isinstance(self.default, bool) and not isinstance(value, bool):
            raise ValueError(f"{self.name} ({strategy}) is True or False, got {value!r}")
        if type(self.default) is int:
            least = 1 if self.minimum is None else self.minimum
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least == 1 else f"an integer of at least {least:g}"
                raise ValueError(f"{self.name} ({strategy}) is {kind}, got {value!r}")
        if isinstance(self.default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{self.name} ({strategy}) is a number, got {value!r}")
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
    axis: str
    order: int  # position when composed on a rank: lower first
    summary: str
    settings: tuple[Setting, ...] = ()
    shards_memory: bool = False  # divides parameters, gradients and optimizer state over its axis
    # Torch-free checks of a resolved config using this strategy; raise ValueError with the reason.
    check: Callable[[Any], None] | None = None
    # Defaults that depend on the mesh (pipeline microbatches; a batch the ps workers divide), filled
    # before the checks for the general settings the user did not give.
    defaults: Callable[[Any], dict] | None = None
    # Each rank's role under this strategy (None: every rank trains the same way).
    roles: Callable[[Any, int], str] | None = None
    # Into how many equal parts the global batch is split (None: the product of the data axes).
    data_parts: Callable[[Any], int] | None = None
    alone: bool = False  # runs by itself only, never in a composition (its ranks have roles of their own)
    no_checkpoints: str = ""  # why its training state cannot be checkpointed yet ("": it can)
    state_copies: int = 0  # copies of each rank's parameters it keeps beside the optimizer (memory estimate)
    module: str = field(default="")

    @property
    def module_name(self) -> str:
        return self.module or f"labkit.strategies.{self.name}"


def _check_pp(config) -> None:
    pp = config.axis("pp")
    config.model_config.check_stages(pp)
    if config.schedule == "1f1b" and config.micro_batches < pp:
        raise ValueError(f"1F1B needs at least as many microbatches as stages: micro_batches >= {pp}")


def _check_tp(config) -> None:
    config.model_config.check_tp(config.axis("tp"), config.sequence_parallel, stages=config.axis("pp"))


def _ps_workers(config) -> int:
    # At least 1, so the general checks that divide by it run before _check_ps refuses a run without workers.
    return max(1, config.axis("dp") - config.servers)


def _ps_defaults(config) -> dict:
    # The general default batch (32) rarely splits over 3 workers: without a batch given, the nearest
    # multiple of the workers (x microbatches) not above it, so the defaults alone run (32 -> 30 for 3).
    unit = _ps_workers(config) * (config.micro_batches or 1)
    return {"global_batch": max(unit, config.global_batch // unit * unit)}


def _check_ps(config) -> None:
    ranks = config.axis("dp")
    if config.servers >= ranks:
        raise ValueError(f"ps with servers={config.servers} on {ranks} ranks leaves no worker: ranks "
                         f"[0, servers) serve, the others compute gradients; use servers <= {ranks - 1}")
    if config.verify and config.staleness:
        raise ValueError(f"verify=True compares with single-process training, which ps with staleness="
                         f"{config.staleness} cannot equal: asynchronous updates are applied in the order they "
                         f"arrive, so there is nothing deterministic to compare with. Verify with staleness=0 "
                         f"(synchronous), or train without verify")


CATALOG: dict[str, Strategy] = {
    entry.name: entry
    for entry in (
        Strategy(
            "ddp", axis="dp", order=2,
            summary="data parallel: a whole model per rank, gradients averaged (torch DDP)",
            settings=(Setting("bucket_cap_mb", 25.0, "DDP gradient bucket size, MB"),),
        ),
        Strategy(
            "fsdp", axis="dp", order=2, shards_memory=True,
            summary="fully sharded data parallel: parameters, gradients and optimizer state sharded (FSDP2)",
            settings=(Setting("reshard_after_forward", True, "FSDP: free gathered parameters after forward",
                              flag="--no-reshard"),),
        ),
        Strategy(
            "tp", axis="tp", order=0, shards_memory=True, check=_check_tp,
            summary="tensor parallel: layers split over ranks (DTensor)",
            settings=(Setting("sequence_parallel", False, "TP: shard norms and residuals by sequence"),),
        ),
        Strategy(
            "pp", axis="pp", order=1, shards_memory=True, check=_check_pp,
            defaults=lambda config: {"micro_batches": config.axis("pp")},
            summary="pipeline parallel: stages of layers, microbatches in flight (torch.distributed.pipelining)",
            settings=(Setting("schedule", "1f1b", "pipeline schedule", choices=("gpipe", "1f1b")),),
        ),
        Strategy(
            "ps", axis="dp", order=2, alone=True, check=_check_ps, defaults=_ps_defaults, data_parts=_ps_workers,
            roles=lambda config, rank: "server" if rank < config.servers else "worker",
            no_checkpoints="its state is split by role (servers hold flat shards of the weights and the "
                           "optimizer, workers a copy of the model) and no checkpoint layout maps it back to "
                           "parameters by name; continue a run with resume=True instead",
            summary="parameter server: servers hold the weights and the optimizer, workers push gradients and "
                    "pull weights (staleness > 0: asynchronous, bounded)",
            settings=(Setting("servers", 1, "ps: ranks that hold the weights (the first ones); the rest are workers"),
                      Setting("staleness", 0, "ps: 0 synchronous; k > 0 asynchronous, a worker at most k pushes "
                                              "ahead of the slowest", minimum=0)),
        ),
        Strategy(
            # Last (order 3): the outer step works on the final, possibly sharded, parameters.
            "diloco", axis="replica", order=3, state_copies=2,  # the global copy and its outer momentum
            summary="DiLoCo: replicas take inner_steps optimizer steps alone, then an outer Nesterov step on "
                    "their averaged parameter change",
            settings=(Setting("inner_steps", 10, "DiLoCo: inner optimizer steps between outer steps (H)"),
                      Setting("outer_lr", 0.7, "DiLoCo: outer learning rate"),
                      Setting("outer_momentum", 0.9, "DiLoCo: outer Nesterov momentum (0: plain SGD)",
                              minimum=0.0, below=1.0)),
        ),
    )
}


def strategy(name: str) -> Strategy:
    return CATALOG[name]


def register(entry: Strategy) -> None:
    """Add a strategy from outside labkit (a plugin, a workshop exercise, a test).

    It must be registered wherever it is used: in the notebook, and on the ranks
    (``lab.run(register, entry)``). Its module must be importable on the ranks."""
    if entry.axis not in AXIS_ORDER:
        raise ValueError(f"strategy {entry.name!r}: axis {entry.axis!r} is not one of {', '.join(AXIS_ORDER)}")
    known = CATALOG.get(entry.name)
    if known is not None and known != entry:
        raise ValueError(f"a different strategy is already called {entry.name!r}")
    taken = {name for name, (owner, _) in settings_by_name().items() if owner != entry.name}
    clashes = sorted(taken & {setting.name for setting in entry.settings})
    if clashes:
        raise ValueError(f"strategy {entry.name!r}: settings {', '.join(clashes)} belong to other strategies")
    CATALOG[entry.name] = entry


def parse_strategy(text) -> tuple[str, ...]:
    """``"fsdp+tp"`` -> ("fsdp", "tp"); unknown names, repeats and two parts on one axis are refused."""
    if not isinstance(text, str):
        raise ValueError(f"a strategy is a name such as 'ddp' or 'fsdp+tp', got {text!r}")
    parts = tuple(part.strip().lower() for part in text.split("+") if part.strip())
    unknown = [part for part in parts if part not in CATALOG]
    if not parts or unknown:
        raise ValueError(
            f"unknown strategy {text!r}: use {', '.join(CATALOG)} or a composition such as fsdp+tp, ddp+pp, pp+tp"
        )
    if len(set(parts)) != len(parts):
        raise ValueError(f"strategy {text!r} names a part twice")
    lonely = [part for part in parts if CATALOG[part].alone]
    if lonely and len(parts) > 1:
        raise ValueError(f"{lonely[0]} runs alone ({CATALOG[lonely[0]].summary}): train with strategy {lonely[0]!r}")
    axes = [CATALOG[part].axis for part in parts]
    for axis in set(axes):
        sharing = [part for part in parts if CATALOG[part].axis == axis]
        if len(sharing) > 1:
            raise ValueError(f"{' and '.join(sharing)} both use the {axis} axis: choose one of them")
    return parts


def axes_of(parts) -> list[str]:
    """The mesh axes a composition needs, outermost first."""
    return sorted({CATALOG[part].axis for part in parts}, key=AXIS_ORDER.index)


def settings_by_name() -> dict[str, tuple[str, Setting]]:
    """Every strategy setting: name -> (owning strategy, setting)."""
    return {setting.name: (entry.name, setting) for entry in CATALOG.values() for setting in entry.settings}


def sharding_alternatives() -> tuple[str, ...]:
    """Single strategies that divide memory: what a refused budget may suggest."""
    return tuple(name for name, entry in CATALOG.items() if entry.shards_memory)


def compositions(world_size: int) -> tuple[str, ...]:
    """Every strategy and composition a lab of ``world_size`` ranks can run: one part per axis, and
    at least 2 ranks on each axis (the tests and benchmarks run them all)."""
    from itertools import combinations

    found = []
    for count in range(1, len(AXIS_ORDER) + 1):
        if 2**count > world_size and count > 1:
            break
        for parts in combinations(CATALOG, count):
            if count > 1 and any(CATALOG[part].alone for part in parts):
                continue
            if len({CATALOG[part].axis for part in parts}) == count:
                found.append("+".join(sorted(parts, key=lambda part: (CATALOG[part].order != 2, part))))
    return tuple(found)


def checkpoint_refusal(parts) -> str | None:
    """Why a run of these parts cannot save or load checkpoints, in words; None when it can."""
    for part in parts:
        if CATALOG[part].no_checkpoints:
            return f"{part} keeps no checkpoints yet: {CATALOG[part].no_checkpoints}"
    return None


def role_of(parts, config, rank: int) -> str:
    """This rank's role in a composition: the first part that assigns roles decides; else 'trainer'."""
    for part in parts:
        entry = CATALOG[part]
        if entry.roles is not None:
            return entry.roles(config, rank)
    return "trainer"
