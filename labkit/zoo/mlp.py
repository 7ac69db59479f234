"""The zoo's MLP, declared: its settings, what it costs, the splits it refuses, its data and its loss.

Regression on (batch, dims[0]) inputs: linear layers with ReLU between them
(the network, ``labkit.zoo.mlp_network``, built on the ranks). Its data is
``TeacherRegression``: targets from a fixed random two-layer network, so the
loss can fall well below that of predicting zeros; its loss the mean squared
error. Named in labkit's ``pyproject.toml`` as ``mlp = "labkit.zoo.mlp:MODEL"``.

Nothing here imports torch until the ranks build the network, make the data or
compute the loss: the notebook reads the declaration to check a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from labkit.zoo.catalog import ModelDeclaration
from labkit.zoo.stages import Layered, stage_slice

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.zoo.data import TeacherRegression


@dataclass(frozen=True)
class MLPConfig(Layered):
    name: ClassVar[str] = "mlp"
    dims: tuple[int, ...] = (128, 512, 512, 512, 128)

    @property
    def layers(self) -> int:  # type: ignore[override]  # Layered's attribute, computed from the widths here
        return len(self.dims) - 1

    @property
    def parameters(self) -> int:
        return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(self.dims, self.dims[1:]))

    def training_flops_per_sample(self) -> int:
        # A weight costs 2 FLOPs (multiply, add) per sample forward and 4 backward
        # (the gradient of the input and of the weight): 6 per parameter.
        return 6 * self.parameters

    def check_tp(self, tp: int, sequence_parallel: bool, stages: int = 1) -> None:
        """Refuse, before anything runs, a split that does not divide the widths it shards.

        Each pipeline stage pairs the layers it holds (``MLP.tp_plan``), so under pp the
        pairs start again at every stage's first layer: each stage's pairs are checked."""
        indices = [str(index) for index in range(self.layers)]
        inner = []
        for stage in range(stages):
            owned = [int(name) for name in stage_slice(indices, stage, stages)]
            # Layer i (column-wise) and i+1 (row-wise) both split width dims[i+1].
            inner += [self.dims[owned[k] + 1] for k in range(0, len(owned) - 1, 2)]
        bad = sorted({width for width in inner if width % tp})
        if bad:
            raise ValueError(f"tp={tp} must divide the widths it splits; {bad} do not (MLP dims {self.dims})")
        if sequence_parallel:
            raise ValueError("sequence parallelism applies to the GPT model (its norms and residual stream)")


def network(settings: MLPConfig) -> nn.Module:
    from labkit.zoo.mlp_network import MLP

    return MLP(settings)


def data(settings: MLPConfig, seed: int) -> TeacherRegression:
    from labkit.zoo.data import TeacherRegression

    return TeacherRegression(settings.dims[0], settings.dims[-1], seed)


def mean_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.mse_loss(output, target)


MODEL = ModelDeclaration(
    "mlp", summary="an MLP regressing a fixed random teacher network's outputs", settings=MLPConfig,
    network=network, data=data, loss=mean_squared_error, list_position=10,
)
