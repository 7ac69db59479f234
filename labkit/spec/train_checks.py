"""The general checks of a resolved training run, before any rank works: pure, no torch.

``check_config`` refuses, saying why and what to change, a setting out of its
range, a combination that cannot hold (``verify`` in bf16, ``auto_heal``
without checkpoints), a batch that does not split over the data-parallel
replicas and micro-batches (``BatchSplitError``, naming the nearest batches
that do), and then whatever each strategy of the composition checks for itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.spec.bounds import MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES, MAX_STEPS, check_lr, check_whole
from labkit.strategies.catalog import checkpoint_refusal, strategy

if TYPE_CHECKING:
    from labkit.spec.train_config import TrainConfig

OPTIMIZERS = {"adamw": 2, "sgd": 0}  # optimizer state tensors per parameter
PRECISIONS = ("fp32", "bf16")
# What a run does at a step whose loss is NaN or infinite (``rank.nonfinite``): the first is the default.
ON_NONFINITE = ("stop", "skip", "continue")


class BatchSplitError(ValueError):
    """The global batch given does not split over the data-parallel replicas and micro-batches."""

    def __init__(self, message: str, nearest: str = "") -> None:
        super().__init__(message)
        self.nearest = nearest  # the nearest batches that split ("15 or 18")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_number(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} is {meaning} (a positive, finite number), got {value!r}")


def check_config(config: TrainConfig) -> None:
    """Refuse, with the reason, a resolved config that cannot run: general settings, then each part's own."""
    for name in ("steps", "global_batch", "micro_batches", "log_every"):
        _positive_int(name, getattr(config, name))
    check_whole("steps", config.steps, MAX_STEPS, "steps=1000 (continue a long run with resume=True)")
    check_whole("micro_batches", config.micro_batches, MAX_MICRO_BATCHES, "micro_batches=4")
    check_whole("global_batch", config.global_batch, MAX_GLOBAL_BATCH, "global_batch=32")
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
    if config.on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite is one of {', '.join(map(repr, ON_NONFINITE))} (what a step whose loss is NaN "
                         f"or infinite does), got {config.on_nonfinite!r}: e.g. on_nonfinite='skip'")
    if config.verify and (config.precision != "fp32" or config.tf32):
        raise ValueError(
            "the equivalence proof (verify=True) compares in strict float32: train with precision='fp32' and "
            "tf32=False to verify, or drop verify to train in bf16 or TF32"
        )
    _check_checkpoints(config)
    if config.peak_tflops is not None:
        _positive_number("peak_tflops", config.peak_tflops, "the device's peak in TFLOP/s")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: choose {', '.join(OPTIMIZERS)}")
    check_lr("lr", config.lr)
    if config.own is not None and config.model_settings:
        raise ValueError(f"model_settings resize a model of the zoo; your own {config.own.name} takes its settings "
                         f"where you build it: model=lambda: {config.own.name}(...)")
    config.model_config  # refuses unknown models and settings
    _check_batch_split(config)
    for part in config.parts:
        own_check = strategy(part).check
        if own_check is not None:
            own_check(config)


def _check_checkpoints(config: TrainConfig) -> None:
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


def _check_batch_split(config: TrainConfig) -> None:
    replicas, micro = config.data_parts, config.micro_batches or 1
    unit = replicas * micro
    if config.global_batch % unit:
        below, above = config.global_batch // unit * unit, (config.global_batch // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        raise BatchSplitError(
            f"global_batch={config.global_batch} must split evenly into {replicas} data-parallel replicas x "
            f"micro_batches={micro}: use a multiple of {unit}, such as {nearest}", nearest
        )
