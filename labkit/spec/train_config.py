"""What a training run asks for, checked in the notebook before any rank does work.

A strategy is one or more installed strategies (``ddp``, ``fsdp``, ``tp``,
``pp``, or a package's; ``strategies.catalog``) joined by ``+`` (``fsdp+tp``,
``ddp+pp``, ``pp+tp``). Each uses the mesh axis its declaration names, and
brings its own settings (e.g. ``bucket_cap_mb`` for ddp), kept in
``TrainConfig.options`` and read through ``config.setting(BUCKET_CAP_MB)``
(the declared ``Setting``, typed as its default; or by name). A single strategy
gets all ranks on its axis; a composition's mesh is chosen by
``spec.mesh_choice``. Settings left out get defaults that run: pipeline
microbatches default to the number of stages, since 1F1B needs at least that
many. ``resolve`` builds the config in steps, one job each: the settings given,
sorted into general and strategy settings; the meshes to try; each mesh's
defaults; the checks (``spec.train_checks``).
Everything here is pure: no processes, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, TypeVar, overload

from labkit.spec.mesh import MeshSpec
from labkit.spec.mesh_choice import GIVEN, even_splits, mesh_candidates
from labkit.spec.own_model import OwnModel
from labkit.spec.train_checks import ON_NONFINITE, OPTIMIZERS, PRECISIONS, BatchSplitError, check_config
from labkit.strategies.catalog import (DATA_AXES, Setting, SettingValueError, axes_of, parse_strategy, settings_by_name,
                                       strategy)
from labkit.units import parse_bytes
from labkit.zoo.catalog import model
from labkit.zoo.plugins import PluginError

__all__ = ["ON_NONFINITE", "OPTIMIZERS", "PRECISIONS", "BatchSplitError", "TrainConfig", "checkpoint_settings",
           "even_splits", "identity_differences", "parse_strategy", "resolve", "resume_differences", "user_settings"]

T = TypeVar("T")


@dataclass(frozen=True)
class TrainConfig:
    """One training run; see ``Lab.train`` for the meaning of each field."""

    strategy: str = "ddp"
    model: str = "mlp"
    steps: int = 20
    global_batch: int = 32
    micro_batches: int | None = None  # None: the number of pipeline stages under pp, else 1
    lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    max_memory: int | None = None
    verify: bool = False
    on_nonfinite: str = "stop"  # a NaN or infinite loss: "stop" the run, "skip" that step's update, or "continue"
    log_every: int = 10
    instruments: bool = True
    precision: str = "fp32"
    tf32: bool = False
    peak_tflops: float | None = None
    checkpoint_every: int | None = None  # steps between checkpoints (with checkpoint_dir)
    checkpoint_dir: str | None = None
    keep_checkpoints: int | None = 3  # the newest this many of a run's checkpoints stay in checkpoint_dir (None: all)
    auto_heal: bool = False  # after a failure: replace ranks, load the last checkpoint, go on
    max_restarts: int = 3
    model_settings: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # the strategies' own settings, defaults filled in
    first_step: int = 0  # steps the rank's training state has taken when this run continues it
    mesh_names: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_reason: str = "given"
    batch_note: str = ""  # how the default global batch was fitted to the mesh, in words ("": as it is)
    own: OwnModel | None = None  # the user's own model, data and loss (``model`` is then its name)
    # A site's part in DiLoCo across sites (runs.site_diloco sets it): the hub's run, key, wire and share sizes.
    outer_hub: dict | None = None

    @overload
    def setting(self, which: Setting[T]) -> T: ...

    @overload
    def setting(self, which: str) -> object: ...

    def setting(self, which: Setting[T] | str) -> T | object:
        """A strategy's setting in this run: ``config.setting(BUCKET_CAP_MB)`` (typed), or by its name.

        LookupError when no part of this run's strategy has it, saying whose it is."""
        name = which if isinstance(which, str) else which.name
        if name in self.options:
            return self.options[name]
        owner = settings_by_name().get(name)
        whose = f"it is {owner[0]}'s, and {self.strategy!r} does not use {owner[0]}" if owner else "no strategy has it"
        raise LookupError(f"this run has no setting {name!r}: {whose}")

    @property
    def parts(self) -> tuple[str, ...]:
        return parse_strategy(self.strategy)

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec(self.mesh_names, self.mesh_shape)

    def axis(self, name: str) -> int:
        return dict(zip(self.mesh_names, self.mesh_shape)).get(name, 1)

    @property
    def dp_kind(self) -> str | None:
        return next((part for part in self.parts if strategy(part).axis == "dp"), None)

    @property
    def data_parts(self) -> int:
        """Into how many equal parts each step's global batch is split (one per data-parallel replica)."""
        for part in self.parts:
            parts_of = strategy(part).data_parts
            if parts_of is not None:
                return parts_of(self)
        return math.prod(self.axis(name) for name in DATA_AXES)

    @property
    def model_config(self) -> Any:
        """The model's settings (its declaration's settings class, ``model_settings`` applied); None for the
        user's own model, which has none."""
        if self.own is not None:
            return None
        return model(self.model).settings_for(self.model_settings)

    def training_flops_per_sample(self) -> int:
        """Model FLOPs of one sample's forward and backward (the zoo's count, or the own model's estimate)."""
        if self.own is not None:
            return self.own.training_flops_per_sample()
        return int(self.model_config.training_flops_per_sample())

    def as_dict(self) -> dict:
        """Every field by name (the own model kept as it is: what was packed is compared by its fingerprint)."""
        return {**asdict(replace(self, own=None)), "own": self.own}

    def describe(self) -> str:
        math = " in bf16" if self.precision == "bf16" else " in TF32" if self.tf32 else ""
        return f"{self.model} under {self.strategy} on mesh {self.mesh.describe()}{math}"


def user_settings() -> set[str]:
    """The general settings a user gives ``lab.train`` (the strategies' own come from the catalog)."""
    return {f.name for f in fields(TrainConfig)} - {"options", "first_step", "mesh_names", "mesh_shape", "mesh_reason",
                                                   "batch_note", "outer_hub"}


# What a continuation (``resume=True``) may change: how long it runs and how it reports.
RESUME_MAY_CHANGE = ("steps", "log_every", "verify", "on_nonfinite", "max_memory", "peak_tflops", "first_step",
                     "mesh_reason", "batch_note", "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "auto_heal",
                     "max_restarts")
# What makes a checkpoint another model: loading it under other values is refused.
MODEL_IDENTITY = ("model", "model_settings", "own")


def checkpoint_settings(config: TrainConfig) -> dict:
    """What a checkpoint records of its run: every setting a user gives, the strategies' own included."""
    settings = {name: value for name, value in config.as_dict().items() if name in user_settings()}
    settings.update(config.options)
    own = settings.pop("own", None)
    if own is not None:  # the model itself travels with each run; a checkpoint names what it must match
        settings["own"] = own.identity
    for name in ("checkpoint_every", "checkpoint_dir", "keep_checkpoints", "auto_heal", "max_restarts", "verify",
                 "max_memory", "on_nonfinite"):
        settings.pop(name, None)  # how that run was watched and kept, not what it trained
    return {"settings": settings, "mesh": dict(zip(config.mesh_names, config.mesh_shape))}


def identity_differences(saved: dict, settings: dict) -> list[str]:
    """How ``settings`` would train another model than the checkpoint's ``saved`` settings, in words."""
    differences = []
    for name in MODEL_IDENTITY:
        then, now = saved.get(name), settings.get(name, saved.get(name))
        if name == "own":  # the user's model is matched by its parameters' names and shapes
            then, now = then or None, _identity(now)
            if then != now:
                differences.append(_own_difference(then, now))
            continue
        if name == "model_settings":  # JSON keeps tuples as lists
            then = {key: tuple(value) if isinstance(value, list) else value for key, value in (then or {}).items()}
            now = {key: tuple(value) if isinstance(value, list) else value for key, value in (now or {}).items()}
        if then != now:
            differences.append(f"{name} is {then!r} in the checkpoint, {now!r} here")
    return differences


def _identity(own: object) -> dict | None:
    return own.identity if isinstance(own, OwnModel) else own if isinstance(own, dict) else None


def _own_difference(then: dict | None, now: dict | None) -> str:
    if then is None:
        return f"the checkpoint holds a model of the zoo, not your {now['name'] if now else 'model'}"
    if now is None:
        return (f"the checkpoint holds your own model {then['name']}: give it again, with its data and loss "
                f"(lab.load(path, model={then['name']}, data=..., loss=...))")
    return (f"the checkpoint's {then['name']} has other parameters (names or shapes) than the {now['name']} "
            "given here")


def resume_differences(before: TrainConfig, after: TrainConfig) -> list[str]:
    """The settings in which ``after`` is not a continuation of ``before``, in words."""
    then, now = before.as_dict(), after.as_dict()
    return [f"{name} was {then[name]!r}, now {now[name]!r}" for name in then
            if name not in RESUME_MAY_CHANGE and then[name] != now[name]]


LARGEST_LAB = 64  # how far the nearest lab size that runs a refused request is looked for


def resolve(world_size: int, mesh: dict | None = None, lab_mesh: MeshSpec | None = None,
            **settings: Any) -> TrainConfig:
    """Build a ``TrainConfig`` and check it against the lab's world size; raise ValueError.

    ``lab_mesh``: the lab's current mesh, used by a composition given no ``mesh``
    when its axes are the ones the composition needs. A request that cannot run
    on ``world_size`` ranks but would on another number of ranks is refused
    naming the nearest such number.
    """
    try:
        return _resolve(world_size, mesh, lab_mesh, **settings)
    except (BatchSplitError, PluginError, SettingValueError):
        raise  # a batch the user gave names the nearest batches that split; an unknown name fits no lab; a
        # setting's value says what to pass
    except ValueError as error:
        if mesh or isinstance(world_size, bool) or not isinstance(world_size, int):
            raise  # a mesh given fixes the number of ranks: its own message says what to change
        sizes = nearest_sizes(world_size, lambda size: _resolve(size, None, None, **settings))
        if not sizes:
            raise
        raise ValueError(f"{error}. These settings run on a lab of {' or '.join(map(str, sizes))} ranks, "
                         f"the nearest size that works") from None


def nearest_sizes(world_size: int, attempt: Callable[[int], object]) -> list[int]:
    """The lab sizes closest to ``world_size`` (both, on a tie) for which ``attempt(size)`` raises no ValueError."""
    for distance in range(1, LARGEST_LAB):
        found = []
        for size in (world_size - distance, world_size + distance):
            if 1 <= size <= LARGEST_LAB:
                try:
                    attempt(size)
                except ValueError:
                    continue
                found.append(size)
        if found:
            return found
    return []


def _fit_default_batch(config: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    """A global batch left at its default becomes the nearest multiple of what it is split into, saying so."""
    default = TrainConfig.global_batch
    replicas, micro = config.data_parts, config.micro_batches
    if "global_batch" in settings or not isinstance(micro, int) or micro < 1:
        return config
    unit = replicas * micro
    batch = config.global_batch
    if batch == default and batch % unit:
        batch = -(-default // unit) * unit  # up: every replica keeps at least the default's share
    if batch == default:
        return config
    parts = " x ".join(([f"{replicas} data-parallel ranks"] if replicas > 1 else []) +
                       ([f"{micro} micro-batches"] if micro > 1 else []))
    direction = "up" if batch > default else "down"
    return replace(config, global_batch=batch,
                   batch_note=f"global batch {batch} ({default} rounded {direction} to a multiple of {parts})")


def _resolve(world_size: int, mesh: dict | None, lab_mesh: MeshSpec | None, **settings: Any) -> TrainConfig:
    config = _given(settings)
    candidates = mesh_candidates(config.strategy, axes_of(config.parts), world_size, mesh, lab_mesh)
    return _first_that_fits(config, candidates, settings, world_size)


def _given(settings: dict[str, Any]) -> TrainConfig:
    """The settings given, sorted: the general ones as fields, each part's own (defaults filled) as options."""
    general = user_settings()
    owned = settings_by_name()
    unknown = sorted(set(settings) - general - set(owned))
    if unknown:
        raise ValueError(f"unknown training setting {', '.join(unknown)}; the settings are "
                         f"{', '.join(sorted(general | set(owned)))}")
    config = TrainConfig(**{name: value for name, value in settings.items() if name in general})
    parts = config.parts
    if config.own is None:
        model(config.model)  # an unknown model is refused by name, as an unknown strategy is
    elif not isinstance(config.own, OwnModel):
        raise ValueError("own is labkit's own record of your model: pass model=YourClass (with data= and loss=)")
    for name in settings:
        if name in owned and owned[name][0] not in parts:
            owner = strategy(owned[name][0])
            raise ValueError(f"{name} is a setting of {owner.name} ({owner.summary}): add {owner.name} to the "
                             f"strategy, or drop {name}")
    options = {}
    for part in parts:
        for setting in strategy(part).settings:
            value = settings.get(setting.name, setting.default)
            setting.check(value, part)
            options[setting.name] = value
    return replace(config, options=options, max_memory=parse_bytes(config.max_memory, "max_memory"))


def _on_mesh(config: TrainConfig, spec: MeshSpec, reason: str, settings: dict[str, Any]) -> TrainConfig:
    """``config`` on mesh ``spec``, with the defaults that depend on the mesh filled in."""
    candidate = replace(config, mesh_names=spec.names, mesh_shape=spec.shape, mesh_reason=reason)
    filled: dict[str, int] = {}
    for part in config.parts:
        defaults = strategy(part).defaults
        filled.update(defaults(candidate) if defaults is not None else {})
    if candidate.micro_batches is None:
        candidate = replace(candidate, micro_batches=filled.get("micro_batches", 1))
    # A strategy's other defaults fill only the general settings not given (ps: a batch its workers divide).
    others: dict[str, Any] = {name: value for name, value in filled.items()
                              if name != "micro_batches" and name not in settings}
    candidate = replace(candidate, **others)
    return _fit_default_batch(candidate, settings)


def _first_that_fits(config: TrainConfig, candidates: list[tuple[MeshSpec, str]], settings: dict[str, Any],
                     world_size: int) -> TrainConfig:
    """The first candidate mesh whose config passes every check; else the first refusal, said for all."""
    first_error: ValueError | None = None
    for spec, reason in candidates:
        candidate = _on_mesh(config, spec, reason, settings)
        try:
            check_config(candidate)
        except ValueError as error:
            first_error = first_error or error
            continue
        return candidate
    assert first_error is not None  # every candidate was refused
    if candidates[0][1] == GIVEN:
        raise first_error
    tried = ", ".join(spec.describe() for spec, _ in candidates)
    needed = ", ".join(candidates[0][0].names)
    raise ValueError(f"no split of {world_size} ranks over {needed} fits this model ({tried} tried; "
                     f"first: {first_error}): change the model settings, or give the mesh yourself")
