"""A strategy's rank side, typed: the ``StrategyModule`` protocol and how a rank finds a strategy's module.

The module that declares a strategy (``STRATEGY``) also applies it::

    def apply(composition: Composition, axis_mesh: DeviceMesh, config: TrainConfig) -> None

``apply`` runs on every rank, in the composition's order (``Strategy.order``),
and changes ``composition`` (``strategies.compose``). A strategy that is not
one-process training by design (DiLoCo's replicas drift apart between outer
steps) also offers ``reference_parameters``: its own single-process simulation,
which ``verify=True`` compares the ranks with instead of plain training.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from labkit.strategies.catalog import Strategy

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition
    from labkit.torch_support.trainable import Trainable

Parameters = dict[str, "torch.Tensor"]  # parameter name -> value


class StrategyModule(Protocol):
    """What every strategy's module offers the ranks."""

    def apply(self, composition: Composition, mesh: DeviceMesh, config: TrainConfig) -> None:
        """Apply the strategy over its axis of the mesh (``mesh``: that axis's one-dimensional mesh)."""


@runtime_checkable
class OwnReference(Protocol):
    """A strategy with its own single-process reference (optional: without it, plain one-process training)."""

    def reference_parameters(self, config: TrainConfig, device: str | torch.device, steps: int, chunks: int = 1,
                             data_share: tuple[int, int] | None = (0, 1),
                             trainable: Trainable | None = None) -> tuple[Parameters, Parameters]:
        """(initial, final) parameters after ``steps`` steps, for the rank with this share of the data
        (``trainable``: what the run trains; default, the catalog model ``config`` names).

        ``chunks`` > 1 sums each gradient in that many parts: the same mathematics,
        another rounding (what ``verify`` measures the run's rounding noise with)."""


def rank_module(entry: Strategy) -> StrategyModule:
    """The module that applies ``entry`` on this rank (imported here, with torch)."""
    module = importlib.import_module(entry.module_name)
    if not callable(getattr(module, "apply", None)):
        raise TypeError(f"strategy {entry.name!r}: its module {entry.module_name} has no apply(composition, mesh, "
                        f"config) function")
    return cast(StrategyModule, module)
