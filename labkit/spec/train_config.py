"""What a training run asks for, checked in the notebook before any rank does work.

A strategy is one or more entries of the strategy catalog (``ddp``, ``fsdp``,
``tp``, ``pp``) joined by ``+`` (``fsdp+tp``, ``ddp+pp``, ``pp+tp``). Each uses
the mesh axis its catalog entry names, and brings its own settings (e.g.
``bucket_cap_mb`` for ddp), kept in ``TrainConfig.options`` and read as
attributes (``config.bucket_cap_mb``). A single strategy gets all
ranks on its axis. A composition takes the mesh it is given (``dp=2, tp=2``);
without one, the lab's current mesh when its axes are the ones needed, else the
most even split of the ranks that the model allows (``mesh_reason`` says which).
Settings left out get defaults that run: pipeline microbatches default to the
number of stages, since 1F1B needs at least that many.
Everything here is pure: no processes, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from labkit.spec.mesh import MeshSpec
from labkit.strategies.catalog import (DATA_AXES, axes_of, checkpoint_refusal, parse_strategy, settings_by_name,
                                       strategy)
from labkit.units import parse_bytes
from labkit.zoo.configs import model_config

OPTIMIZERS = {"adamw": 2, "sgd": 0}  # optimizer state tensors per parameter
PRECISIONS = ("fp32", "bf16")


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

    def __getattr__(self, name: str):
        # A strategy's setting reads like a field: config.bucket_cap_mb.
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"TrainConfig has no setting {name!r}")

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
            if strategy(part).data_parts is not None:
                return strategy(part).data_parts(self)
        return math.prod(self.axis(name) for name in DATA_AXES)

    @property
    def model_config(self):
        return model_config(self.model, **self.model_settings)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        math = " in bf16" if self.precision == "bf16" else " in TF32" if self.tf32 else ""
        return f"{self.model} under {self.strategy} on mesh {self.mesh.describe()}{math}"


def user_settings() -> set[str]:
    """The general settings a user gives ``lab.train`` (the strategies' own come from the catalog)."""
    return {f.name for f in fields(TrainConfig)} - {"options", "first_step", "mesh_names", "mesh_shape", "mesh_reason",
                                                   "batch_note"}


# What a continuation (``resume=True``) may change: how long it runs and how it reports.
RESUME_MAY_CHANGE = ("steps", "log_every", "verify", "max_memory", "peak_tflops", "first_step", "mesh_reason", "batch_note",
                     "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "auto_heal", "max_restarts")
# What makes a checkpoint another model: loading it under other values is refused.
MODEL_IDENTITY = ("model", "model_settings")


def checkpoint_settings(config: TrainConfig) -> dict:
    """What a checkpoint records of its run: every setting a user gives, the strategies' own included."""
    settings = {name: value for name, value in config.as_dict().items() if name in user_settings()}
    settings.update(config.options)
    for name in ("checkpoint_every", "checkpoint_dir", "keep_checkpoints", "auto_heal", "max_restarts", "verify",
                 "max_memory"):
        settings.pop(name, None)  # how that run was watched and kept, not what it trained
    return {"settings": settings, "mesh": dict(zip(config.mesh_names, config.mesh_shape))}


def identity_differences(saved: dict, settings: dict) -> list[str]:
    """How ``settings`` would train another model than the checkpoint's ``saved`` settings, in words."""
    differences = []
    for name in MODEL_IDENTITY:
        then, now = saved.get(name), settings.get(name, saved.get(name))
        if name == "model_settings":  # JSON keeps tuples as lists
            then = {key: tuple(value) if isinstance(value, list) else value for key, value in (then or {}).items()}
            now = {key: tuple(value) if isinstance(value, list) else value for key, value in (now or {}).items()}
        if then != now:
            differences.append(f"{name} is {then!r} in the checkpoint, {now!r} here")
    return differences


def resume_differences(before: TrainConfig, after: TrainConfig) -> list[str]:
    """The settings in which ``after`` is not a continuation of ``before``, in words."""
    then, now = before.as_dict(), after.as_dict()
    return [f"{name} was {then[name]!r}, now {now[name]!r}" for name in then
            if name not in RESUME_MAY_CHANGE and then[name] != now[name]]


class BatchSplitError(ValueError):
    """The global batch given does not split over the data-parallel replicas and micro-batches."""


LARGEST_LAB = 64  # how far the nearest lab size that runs a refused request is looked for


def resolve(world_size: int, mesh: dict | None = None, lab_mesh: MeshSpec | None = None, **settings) -> TrainConfig:
    """Build a ``TrainConfig`` and check it against the lab's world size; raise ValueError.

    ``lab_mesh``: the lab's current mesh, used by a composition given no ``mesh``
    when its axes are the ones the composition needs. A request that cannot run
    on ``world_size`` ranks but would on another number of ranks is refused
    naming the nearest such number.
    """
    try:
        return _resolve(world_size, mesh, lab_mesh, **settings)
    except BatchSplitError:
        raise  # a batch the user gave: its message names the nearest batches that split
    except ValueError as error:
        if mesh or isinstance(world_size, bool) or not isinstance(world_size, int):
            raise  # a mesh given fixes the number of ranks: its own message says what to change
        sizes = nearest_sizes(world_size, lambda size: _resolve(size, None, None, **settings))
        if not sizes:
            raise
        raise ValueError(f"{error}. These settings run on a lab of {' or '.join(map(str, sizes))} ranks, "
                         f"the nearest size that works") from None


def nearest_sizes(world_size: int, attempt) -> list[int]:
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


def _fit_default_batch(config: TrainConfig, settings: dict) -> TrainConfig:
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
def _resolve(world_size: int, mesh: dict | None, lab_mesh: MeshSpec | None, **settings) -> TrainConfig:
    general = user_settings()
    owned = settings_by_name()
    unknown = sorted(set(settings) - general - set(owned))
    if unknown:
        raise ValueError(f"unknown training setting {', '.join(unknown)}; the settings are "
                         f"{', '.join(sorted(general | set(owned)))}")
    config = TrainConfig(**{name: value for name, value in settings.items() if name in general})
    parts = config.parts
    options = {}
    for name, value in settings.items():
        if name in owned and owned[name][0] not in parts:
            owner = strategy(owned[name][0])
            raise ValueError(f"{name} is a setting of {owner.name} ({owner.summary}): add {owner.name} to the "
                             f"strategy, or drop {name}")
    for part in parts:
        for setting in strategy(part).settings:
            value = settings.get(setting.name, setting.default)
            setting.check(value, part)
            options[setting.name] = value
    needed = axes_of(parts)
    config = replace(config, options=options, max_memory=parse_bytes(config.max_memory, "max_memory"))
    if mesh:
        spec = MeshSpec.from_axes(mesh, world_size)
        if set(spec.names) != set(needed):
            raise ValueError(
                f"strategy {config.strategy} uses mesh axes {', '.join(needed)}; the mesh given has {', '.join(spec.names)}"
            )
        candidates = [(spec, "given")]
    elif len(needed) == 1:
        candidates = [(MeshSpec((needed[0],), (world_size,)), "given")]
    elif lab_mesh is not None and set(lab_mesh.names) == set(needed):
        candidates = [(lab_mesh, "the lab's mesh")]
    else:
        candidates = [(MeshSpec(tuple(needed), shape), f"the most even split of {world_size} ranks that fits")
                      for shape in even_splits(world_size, len(needed))]
        if not candidates:
            raise ValueError(
                f"{world_size} ranks cannot be split over {len(needed)} axes ({', '.join(needed)}) of at least 2 "
                f"ranks each: use a single strategy, or a lab whose size has such factors (4 ranks: "
                f"{' x '.join(f'{axis}=2' for axis in needed[:2])})"
            )
    first_error = None
    for spec, reason in candidates:
        candidate = replace(config, mesh_names=spec.names, mesh_shape=spec.shape, mesh_reason=reason)
        filled = {}
        for part in parts:
            filled.update(strategy(part).defaults(candidate) if strategy(part).defaults else {})
        if candidate.micro_batches is None:
            candidate = replace(candidate, micro_batches=filled.get("micro_batches", 1))
        # A strategy's other defaults fill only the general settings not given (ps: a batch its workers divide).
        candidate = replace(candidate, **{name: value for name, value in filled.items()
                                          if name != "micro_batches" and name not in settings})
        candidate = _fit_default_batch(candidate, settings)
        try:
            _check(candidate)
        except ValueError as error:
            first_error = first_error or error
            continue
        return candidate
    if candidates[0][1] == "given":
        raise first_error
    tried = ", ".join(spec.describe() for spec, _ in candidates)
    raise ValueError(f"no split of {world_size} ranks over {', '.join(needed)} fits this model ({tried} tried; "
                     f"first: {first_error}): change the model settings, or give the mesh yourself")


def even_splits(world_size: int, axes: int) -> list[tuple[int, ...]]:
    """Every way to split ``world_size`` ranks over ``axes`` axes of size >= 2, most even first."""
    def splits(remaining: int, count: int):
        if count == 1:
            if remaining >= 2:
                yield (remaining,)
            return
        for size in range(2, remaining + 1):
            if remaining % size == 0:
                for rest in splits(remaining // size, count - 1):
                    yield (size, *rest)

    return sorted(splits(world_size, axes), key=lambda shape: (max(shape) / min(shape), shape))


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_number(name: str, value, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} is {meaning} (a positive, finite number), got {value!r}")


def _check(config: TrainConfig) -> None:
    for name in ("steps", "global_batch", "micro_batches", "log_every"):
        _positive_int(name, getattr(config, name))
    for name in ("verify", "instruments", "tf32", "auto_heal"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} is True or False, got {getattr(config, name)!r}")
    seed = config.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed is an integer from 0 to 2**63 - 1, got {seed!r}")
    if not isinstance(config.model_settings, dict):
        raise ValueError(f"model_settings is a dict such as dict(dim=128, layers=8), got {config.model_settings!r}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {config.precision!r}: choose {' or '.join(PRECISIONS)}")
    if config.verify and (config.precision != "fp32" or config.tf32):
        raise ValueError(
            "the equivalence proof (verify=True) compares in strict float32: train with precision='fp32' and "
            "tf32=False to verify, or drop verify to train in bf16 or TF32"
        )
    if config.checkpoint_every is not None:
        _positive_int("checkpoint_every", config.checkpoint_every)
        if checkpoint_refusal(config.parts):
            raise ValueError(f"checkpoint_every: {checkpoint_refusal(config.parts)}")
        if not isinstance(config.checkpoint_dir, str) or not config.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir, the directory the checkpoints go in")
    elif config.checkpoint_dir is not None and not isinstance(config.checkpoint_dir, str):
        raise ValueError(f"checkpoint_dir is a directory's path, got {config.checkpoint_dir!r}")
    _positive_int("max_restarts", config.max_restarts)
    if config.keep_checkpoints is not None:
        _positive_int("keep_checkpoints", config.keep_checkpoints)
    if config.auto_heal and config.checkpoint_every is None:
        raise ValueError("auto_heal goes back to the last checkpoint: give checkpoint_every and checkpoint_dir too")
    if config.peak_tflops is not None:
        _positive_number("peak_tflops", config.peak_tflops, "the device's peak in TFLOP/s")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: choose {', '.join(OPTIMIZERS)}")
    _positive_number("lr", config.lr, "the learning rate")
    config.model_config  # refuses unknown models and settings
    replicas = config.data_parts
    unit = replicas * config.micro_batches
    if config.global_batch % unit:
        below, above = config.global_batch // unit * unit, (config.global_batch // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        raise BatchSplitError(
            f"global_batch={config.global_batch} must split evenly into {replicas} data-parallel replicas x "
            f"micro_batches={config.micro_batches}: use a multiple of {unit}, such as {nearest}"
        )
    for part in config.parts:
        if strategy(part).check is not None:
            strategy(part).check(config)
