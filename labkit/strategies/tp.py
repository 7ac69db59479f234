"""Tensor parallelism with DTensor's ``parallelize_module``: one layer split over ranks.

The classic pairing (Megatron): a column-wise linear layer splits its output
features, so each rank computes its slice of the activations with no
communication; the following row-wise layer splits its input features, so each
rank computes a partial sum, and one all-reduce makes the output whole.

Which layers pair up is the model's to say (``zoo.model_protocol``): it offers
a ``tp_plan(sequence_parallel)`` that maps its submodule names to DTensor
styles, and ``apply_tp`` hands that plan to ``parallelize_module``. In the zoo's
GPT block, q/k/v are column-wise (each rank owns some attention heads) and the
output projection row-wise; in the MLP, even layers column-wise and the next
row-wise. In the notebook, the model's settings may refuse a split first
(``check_tp``: heads or widths that ``tp`` does not divide).

Sequence parallelism (``sequence_parallel=True``, GPT only) also splits the
parts that column/row pairs leave whole: LayerNorms and the residual stream are
sharded along the sequence. The all-reduce becomes a reduce-scatter (into
sequence shards) plus an all-gather before the next attention or MLP: the same
bytes, but activations outside the pairs take 1/tp of the memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.strategies.catalog import Setting, Strategy
from labkit.zoo.model_protocol import ChecksTensorParallel, HasTensorParallelPlan

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

SEQUENCE_PARALLEL = Setting("sequence_parallel", False, "TP: shard norms and residuals by sequence")


def check(config: TrainConfig) -> None:
    """The model's own refusal of this split, in the notebook (heads or widths tp does not divide)."""
    settings = config.model_config
    if isinstance(settings, ChecksTensorParallel):
        settings.check_tp(config.axis("tp"), config.setting(SEQUENCE_PARALLEL), stages=config.axis("pp"))


STRATEGY = Strategy(
    "tp", axis="tp", order=0, shards_memory=True, check=check, list_position=30,
    summary="tensor parallel: layers split over ranks (DTensor)",
    settings=(SEQUENCE_PARALLEL,),
    model_options=("tp_plan",),
)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
             plan: object | None = None) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` by the plan it offers (``plan``: what speaks for it, else itself)."""
    from torch.distributed.tensor.parallel import parallelize_module

    offered = model if plan is None else plan
    if not isinstance(offered, HasTensorParallelPlan):
        raise TypeError(
            f"no tensor-parallel plan for {type(model).__name__}: give it a tp_plan(sequence_parallel) method "
            "that maps its submodule names to DTensor parallel styles"
        )
    return parallelize_module(model, tp_mesh, offered.tp_plan(sequence_parallel))


def apply(composition: Composition, tp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Shard the model's layers over the tp axis by its own plan; torch's DDP cannot hold the result."""
    apply_tp(composition.model, tp_mesh, config.setting(SEQUENCE_PARALLEL), plan=composition.plan)
    composition.reducer_unfit.append("tensor-parallel (DTensor) parameters")
