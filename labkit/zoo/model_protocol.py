"""What a model offers the strategies: the ``Model`` protocol, and what its settings and data offer.

A strategy never asks which model it trains; it asks what the model offers.
On the ranks that is the built network (or, for a network that cannot say it
itself, an object that speaks for it: ``Composition.plan``):

- ``keep_stage(stage, stages)``: cut it down to one pipeline stage, keeping
  every parameter's name. Without it: no pipeline parallelism (``pp`` refuses
  the model on the ranks, saying what to add).
- ``tp_plan(sequence_parallel)``: which submodules tensor parallelism splits,
  and how (module names to DTensor parallel styles; a name may use ``*`` for
  any one part, as ``parallelize_module`` reads them). Without it: no tensor
  parallelism (``tp`` refuses, saying what to add).
- ``fsdp_units()``: the modules FSDP shards as units of their own (a
  transformer's blocks), so only one unit's parameters are gathered at a time.
  Without it: FSDP shards the whole model as one unit; it trains the same,
  but every parameter is gathered at once (more memory at the peak, and no
  unit's gather overlapped with another's compute).

In the notebook, before any rank works, the model's settings (``ModelSettings``)
say what it costs, and may refuse splits it cannot take: ``check_stages(pp)``
and ``check_tp(tp, sequence_parallel, stages)``. Without them a split the model
cannot take fails on the ranks, as a shape error, instead of in the notebook.

Everything here is a ``typing.Protocol``: a model offers these by having the
methods, whatever its class. Torch is named for the type checker only, so the
notebook side imports this module without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle


@runtime_checkable
class SplitsIntoStages(Protocol):
    """How the model splits into pipeline stages (optional: without it, no ``pp``)."""

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop everything pipeline ``stage`` of ``stages`` does not own; the names of what stays do not change."""


@runtime_checkable
class SplitsByTracing(Protocol):
    """A pipeline stage made as a module of its own, by tracing the network (what speaks for a user's network
    offers it where the network cannot cut itself down)."""

    def split_stage(self, stage: int, stages: int) -> nn.Module:
        """The module of pipeline ``stage`` of ``stages``, its parameters named as in the whole network."""


@runtime_checkable
class HasTensorParallelPlan(Protocol):
    """How tensor parallelism splits the model (optional: without it, no ``tp``)."""

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Submodule names (``*`` for any one part) to DTensor styles, for the submodules this model holds now."""


@runtime_checkable
class HasFsdpUnits(Protocol):
    """Which modules FSDP shards as units of their own (optional: without it, the whole model is one unit)."""

    def fsdp_units(self) -> list[nn.Module]:
        """The repeated blocks, each sharded and gathered on its own; the root holds what is left."""


class Model(SplitsIntoStages, HasTensorParallelPlan, HasFsdpUnits, Protocol):
    """Everything a model can offer the strategies (each part optional; see the module docstring).

    The zoo's networks offer all of it themselves; the strategies test for each
    part (``isinstance(plan, HasTensorParallelPlan)``) and say what is missing."""


class ModelSettings(Protocol):
    """A model's settings (a frozen dataclass whose fields all have defaults), read in the notebook."""

    @property
    def parameters(self) -> int:
        """How many parameters the model has with these settings."""

    def training_flops_per_sample(self) -> int:
        """Model FLOPs of one sample's forward and backward (what MFU divides by the device's peak)."""


@runtime_checkable
class ChecksStages(Protocol):
    """Settings that refuse, in the notebook, a pipeline split the model cannot take (optional)."""

    def check_stages(self, stages: int) -> None:
        """Raise ValueError, naming the shape at fault, when the model cannot be cut into ``stages``."""


@runtime_checkable
class ChecksTensorParallel(Protocol):
    """Settings that refuse, in the notebook, a tensor-parallel split the model cannot take (optional)."""

    def check_tp(self, tp: int, sequence_parallel: bool, stages: int = 1) -> None:
        """Raise ValueError, naming the width at fault, when ``tp`` (per pipeline stage) does not divide it."""


class Batches(Protocol):
    """A model's data: any step's global batch, the same on every rank and in the single-process reference.

    A batch is ``(inputs, targets)`` for the catalog's models; a user's own data may make any tensor, or
    tuples, lists or dicts of them (``torch_support.own_data``). Data may also offer
    ``share(step, size, index, parts)``: one rank's part of that batch made without the rest."""

    def batch(self, step: int, size: int) -> Any:
        """Batch ``step``: ``size`` samples (rows), a pure function of the seed and step."""
