"""A model from outside labkit: a two-layer MLP regressing a fixed random linear map.

One declaration (``MODEL``), named by this package's entry point: its settings
(``width``, ``features``) with what they cost, and how the ranks make its
network (``tiny_network``), its data and its loss. It offers FSDP its two
layers as units; it offers no pipeline stages or tensor-parallel plan, so
``pp`` and ``tp`` refuse it on the ranks, saying what to add.

Nothing here imports torch until the ranks call these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit.zoo.catalog import ModelDeclaration

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class TinySettings:
    features: int = 8
    width: int = 32

    @property
    def parameters(self) -> int:
        return 2 * (self.features * self.width) + self.width + self.features

    def training_flops_per_sample(self) -> int:
        return 6 * self.parameters


class LinearTargets:
    """Inputs and targets of a fixed random linear map, a pure function of (seed, step)."""

    def __init__(self, features: int, seed: int) -> None:
        import torch

        self.features, self.seed = features, seed
        self.weight = torch.randn(features, features, generator=torch.Generator().manual_seed(seed))

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        inputs = torch.randn(size, self.features, generator=torch.Generator().manual_seed(self.seed * 7919 + step))
        return inputs, inputs @ self.weight


def network(settings: TinySettings) -> nn.Module:
    from tiny_lab_plugin.tiny_network import TinyNet

    return TinyNet(settings.features, settings.width)


def data(settings: TinySettings, seed: int) -> LinearTargets:
    return LinearTargets(settings.features, seed)


def mean_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.mse_loss(output, target)


MODEL = ModelDeclaration("tiny_mlp", summary="a two-layer MLP learning a random linear map", settings=TinySettings,
                         network=network, data=data, loss=mean_squared_error)
