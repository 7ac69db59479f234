"""The optimizer a training run builds over what a rank holds: the loop's, the reference's, DiLoCo's inner ones."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.tensor import DTensor


class OptimizerSettings(Protocol):
    """What an optimizer is built from: a run's ``TrainConfig`` offers both (read only: a frozen config will do)."""

    @property
    def optimizer(self) -> str: ...  # "sgd" or "adamw"

    @property
    def lr(self) -> float: ...


def make_optimizer(parameters, config: OptimizerSettings,
                   device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """SGD or AdamW over ``parameters``.

    On CPU, one tensor at a time (``foreach=False``): the same per-parameter
    arithmetic on plain and sharded tensors. On a GPU that would launch a dozen
    small kernels per parameter, so AdamW updates many tensors per kernel
    (``foreach``); a foreach kernel cannot mix DTensors with plain tensors, so
    they go in separate parameter groups.
    """
    parameters = list(parameters)
    foreach = device.type == "cuda"
    if foreach:
        sharded = [p for p in parameters if isinstance(p, DTensor)]
        plain = [p for p in parameters if not isinstance(p, DTensor)]
        parameters = [{"params": group} for group in (sharded, plain) if group]
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=config.lr, foreach=foreach)
    return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=0.0, foreach=foreach)
