"""The zoo's MLP network: linear layers with ReLU between them, and how it splits.

Regression on (batch, dims[0]) inputs. The layers sit in an ``nn.ModuleDict``
keyed "0", "1", ... so that a pipeline stage can drop the layers it does not
own and every parameter keeps its name (``layers.2.weight`` is the same tensor
on one machine and on stage 1 of 2): that is what lets a distributed run be
compared, parameter by parameter, with single-process training.

Its tensor-parallel plan pairs the layers Megatron-style: layer i column-wise,
layer i+1 row-wise, so only the second of each pair communicates.
``MLPConfig.check_tp`` refuses the widths such a plan cannot divide. Each layer
is an FSDP unit of its own. The model's declaration (settings, data, loss) is
``labkit.zoo.mlp``; this module is what the ranks build, with torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from labkit.zoo.stages import stage_slice

if TYPE_CHECKING:  # the settings class only names a type here: its module imports this one on the ranks
    from labkit.zoo.mlp import MLPConfig


class MLP(nn.Module):
    """Linear layers with ReLU between them; regression on (batch, dims[0]) inputs."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(config.dims[i], config.dims[i + 1]) for i in range(config.layers)}
        )
        self.last_layer = str(config.layers - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if name != self.last_layer:
                x = F.relu(x)
        return x

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop every layer not owned by pipeline ``stage`` of ``stages``."""
        for name in stage_slice(list(self.layers), stage, stages, invert=True):
            del self.layers[name]

    def fsdp_units(self) -> list[nn.Module]:
        """Every layer this stage holds: FSDP gathers one layer's parameters at a time."""
        return list(self.layers.values())

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Pair the layers: even layers column-wise, the next one row-wise; an odd last layer stays whole.

        The pairs follow the layer names this stage still holds, so a pipeline
        stage gets a plan for its own layers. ``sequence_parallel`` changes
        nothing: the MLP has no norms or residual stream to shard by sequence,
        and ``MLPConfig.check_tp`` refuses it before a run starts.
        """
        names = list(self.layers)
        plan: dict[str, ParallelStyle] = {}
        for first, second in zip(names[0::2], names[1::2]):
            plan[f"layers.{first}"] = ColwiseParallel()
            plan[f"layers.{second}"] = RowwiseParallel()
        return plan
