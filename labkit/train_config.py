"""What a training run asks for, checked in the notebook before any rank does work.

A strategy is one or more of ``ddp``, ``fsdp``, ``tp``, ``pp`` joined by ``+``
(``fsdp+tp``, ``ddp+pp``, ``pp+tp``). Each uses one mesh axis: ddp and fsdp the
``dp`` axis, tp the ``tp`` axis, pp the ``pp`` axis. A single strategy gets all
ranks on its axis. A composition takes the mesh it is given (``dp=2, tp=2``);
without one, the lab's current mesh when its axes are the ones needed, else the
most even split of the ranks that the model allows (``mesh_reason`` says which).
Settings left out get defaults that run: pipeline microbatches default to the
number of stages, since 1F1B needs at least that many.
Everything here is pure: no processes, no torch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace

from .mesh import MeshSpec
from .model_configs import model_config

PARTS = ("ddp", "fsdp", "tp", "pp")
AXIS_OF = {"ddp": "dp", "fsdp": "dp", "tp": "tp", "pp": "pp"}
AXIS_ORDER = ("pp", "dp", "tp")  # outermost first: tp innermost keeps its groups on neighbouring ranks
OPTIMIZERS = {"adamw": 2, "sgd": 0}  # optimizer state tensors per parameter
PRECISIONS = ("fp32", "bf16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value) -> int | None:
    """``"64MB"`` -> 64_000_000, ``"64MiB"`` -> 67_108_864, an int stays as is, None stays None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.match(str(value))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"a memory size is written like 64MB, 1.5GiB or 500000 (bytes); got {value!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def format_bytes(count: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def parse_strategy(text: str) -> tuple[str, ...]:
    parts = tuple(part.strip().lower() for part in text.split("+") if part.strip())
    unknown = [part for part in parts if part not in PARTS]
    if not parts or unknown:
        raise ValueError(
            f"unknown strategy {text!r}: use {', '.join(PARTS)} or a composition such as fsdp+tp, ddp+pp, pp+tp"
        )
    if len(set(parts)) != len(parts):
        raise ValueError(f"strategy {text!r} names a part twice")
    if "ddp" in parts and "fsdp" in parts:
        raise ValueError("ddp and fsdp both use the dp axis: choose one of them")
    return parts


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
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    max_memory: int | None = None
    verify: bool = False
    log_every: int = 10
    instruments: bool = True
    precision: str = "fp32"
    tf32: bool = False
    peak_tflops: float | None = None
    model_settings: dict = field(default_factory=dict)
    mesh_names: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_reason: str = "given"

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
        return next((part for part in self.parts if part in ("ddp", "fsdp")), None)

    @property
    def model_config(self):
        return model_config(self.model, **self.model_settings)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        math = " in bf16" if self.precision == "bf16" else " in TF32" if self.tf32 else ""
        return f"{self.model} under {self.strategy} on mesh {self.mesh.describe()}{math}"


def resolve(world_size: int, mesh: dict | None = None, lab_mesh: MeshSpec | None = None, **settings) -> TrainConfig:
    """Build a ``TrainConfig`` and check it against the lab's world size; raise ValueError.

    ``lab_mesh``: the lab's current mesh, used by a composition given no ``mesh``
    when its axes are the ones the composition needs.
    """
    known = {f.name for f in fields(TrainConfig)} - {"mesh_names", "mesh_shape", "mesh_reason"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown training setting {', '.join(unknown)}; the settings are {', '.join(sorted(known))}")
    config = TrainConfig(**settings)
    parts = config.parts
    needed = sorted({AXIS_OF[part] for part in parts}, key=AXIS_ORDER.index)
    config = replace(config, max_memory=parse_bytes(config.max_memory))
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
        if candidate.micro_batches is None:
            candidate = replace(candidate, micro_batches=candidate.axis("pp") if "pp" in parts else 1)
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


def _check(config: TrainConfig) -> None:
    for name, value in (("steps", config.steps), ("global_batch", config.global_batch), ("micro_batches", config.micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {config.precision!r}: choose {' or '.join(PRECISIONS)}")
    if config.verify and (config.precision != "fp32" or config.tf32):
        raise ValueError(
            "the equivalence proof (verify=True) compares in strict float32: train with precision='fp32' and "
            "tf32=False to verify, or drop verify to train in bf16 or TF32"
        )
    peak = config.peak_tflops
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0):
        raise ValueError(f"peak_tflops is the device's peak in TFLOP/s (a positive number), got {config.peak_tflops!r}")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: choose {', '.join(OPTIMIZERS)}")
    if not config.lr > 0:
        raise ValueError(f"lr must be positive, got {config.lr!r}")
    model = config.model_config  # refuses unknown models and settings
    dp, tp, pp = config.axis("dp"), config.axis("tp"), config.axis("pp")
    if config.global_batch % (dp * config.micro_batches):
        raise ValueError(
            f"global_batch={config.global_batch} must split evenly into dp={dp} replicas x "
            f"micro_batches={config.micro_batches}"
        )
    if "pp" in config.parts:
        layers = model.layers
        if pp > layers:
            raise ValueError(f"pp={pp} stages need at least {pp} layers; {config.model} has {layers}")
        if config.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown pipeline schedule {config.schedule!r}: choose gpipe or 1f1b")
        if config.micro_batches < pp and config.schedule == "1f1b":
            raise ValueError(f"1F1B needs at least as many microbatches as stages: micro_batches >= {pp}")
    if "tp" in config.parts:
        check_tp(config.model, model, tp, config.sequence_parallel)
    elif config.sequence_parallel:
        raise ValueError("sequence_parallel is part of tensor parallelism: add tp to the strategy")


def check_tp(model_name: str, config, tp: int, sequence_parallel: bool) -> None:
    """Refuse, before anything runs, a split that does not divide the model's shapes."""
    if model_name == "mlp":
        # Layer i (column-wise) and i+1 (row-wise) both split width dims[i+1].
        inner = [config.dims[i + 1] for i in range(0, config.layers - 1, 2)]
        bad = [width for width in inner if width % tp]
        if bad:
            raise ValueError(f"tp={tp} must divide the widths it splits; {bad} do not (MLP dims {config.dims})")
        if sequence_parallel:
            raise ValueError("sequence parallelism applies to the GPT model (its norms and residual stream)")
        return
    if config.heads % tp:
        raise ValueError(f"tp={tp} must divide the number of attention heads ({config.heads})")
    if (config.mlp_ratio * config.dim) % tp:
        raise ValueError(f"tp={tp} must divide the MLP width ({config.mlp_ratio * config.dim})")
    if sequence_parallel and config.seq % tp:
        raise ValueError(f"sequence parallelism needs tp={tp} to divide the sequence length ({config.seq})")
