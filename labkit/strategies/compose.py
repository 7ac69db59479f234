"""Every part of a strategy composed on a rank, in the declared order, into one ``ParallelModel``.

``parallelize(model, mesh, config, ...)`` builds a ``Composition`` and hands it
to each part's ``apply(composition, axis_mesh, config)`` (its module,
``rank_side.StrategyModule``), lowest ``order`` first: with the built-ins,
tensor parallelism shards layers, pipeline parallelism keeps this rank's stage,
data parallelism (DDP or FSDP2) wraps what is left. A part may replace the
model, add a gradient synchronisation to run after backward, say how a
gradient-accumulation micro-step skips it, wrap the optimizer step, leave work
for after every part has applied (the pipeline's runner needs the final model),
give this rank a role, or keep state of its own that checkpoints carry
(``extra_state``: DiLoCo's). Nothing here names a strategy: what differs is in
the parts' declarations and in what their ``apply`` sets.

What a part asks of the model goes through ``composition.plan``, the
``zoo.model_protocol.Model`` parts the model offers: the zoo's networks offer
them themselves; for a user's own network the trainable gives an object that
speaks for it (``torch_support.trainable.OwnPlan``). A batch is whatever the
trainable makes (``torch_support.batches``); the trainable calls the network
on it and computes the loss.

The result, a ``ParallelModel``, runs one step's forward and backward for this
rank and then the optimizer step, whatever the composition, so the training
loop is the same for all.

Precision: float32 by default (the equivalence proof runs in it). With
``precision="bf16"`` FSDP casts parameters to bfloat16 for compute and reduces
gradients in float32 (its ``MixedPrecisionPolicy``); everything else runs the
forward under ``torch.autocast`` in bfloat16, keeping float32 master weights.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
import torch.nn as nn

from labkit.strategies.catalog import DATA_AXES, role_of, strategy
from labkit.strategies.rank_side import rank_module
from labkit.torch_support.batches import chunk_rows

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.torch_support.trainable import Trainable

Batch = Any  # a tensor, or tuples / lists / dicts of them (``torch_support.batches``)


def autocast_for(precision: str, device: torch.device) -> Callable[[], ContextManager[Any]]:
    """A context that runs the forward in ``precision`` (bf16: autocast; fp32: nothing)."""
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class ParallelModel:
    """This rank's share of the model and how to run a step on it.

    ``backward_watch(loss)`` is entered around each backward pass; the GPU
    instruments set it to note where the device waits for gradient communication.
    """

    def __init__(self, composition: Composition,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext, role: str = "trainer") -> None:
        # What the parts built, as they left it (see Composition for each field).
        self.module = composition.model
        self.trainable = composition.trainable
        self.micro_batches = composition.config.micro_batches or 1
        self.runner = composition.runner
        self.micro_step = composition.micro_step
        self.grad_syncs = list(composition.grad_syncs)
        self.step_wrappers = list(composition.step_wrappers)
        self.data_share = composition.data_share  # (index, parts) of each global batch; None: takes no data
        self.loss_groups = list(composition.loss_groups)
        self.update = composition.update
        self.forward = composition.forward
        self.extra_state = dict(composition.extra_state)
        # Kept by reference: the part fills it, the loop empties it at each run's start.
        self.strategy_results = composition.strategy_results
        self.reference_view = composition.reference_view
        self.batch_position = composition.batch_position
        self.finished = composition.finished
        self.lockstep = composition.lockstep
        self.autocast = autocast
        self.role = role
        self.backward_watch: Callable[[torch.Tensor], ContextManager[Any]] = lambda loss: contextlib.nullcontext()

    @property
    def owns_loss(self) -> bool:
        """Whether this rank computes the loss (under PP only the last stage does; a server never)."""
        if self.data_share is None:
            return False
        return self.runner is None or self.runner.is_last

    def forward_backward(self, batch: Batch) -> torch.Tensor | None:
        """Gradients of the mean loss over this rank's share of the batch; that loss where this rank has it.

        The loss comes back as a 0-d tensor on the rank's device: reading it
        (``float``) would make the CPU wait for the GPU every step.
        """
        if self.forward is not None:
            loss = self.forward(batch)
        elif self.runner is not None:
            with self.autocast():
                loss = self.runner.step(batch)
        else:
            trainable = self.trainable
            if trainable is None:
                raise RuntimeError("this composition has no loss: it was built to estimate memory, not to train")
            loss = None
            pieces = chunk_rows(batch, self.micro_batches)
            for index, piece in enumerate(pieces):
                last = index == len(pieces) - 1
                with self.micro_step(last):
                    with self.autocast():
                        micro_loss = trainable.loss(trainable.call(self.module, piece), piece) / len(pieces)
                    with self.backward_watch(micro_loss):
                        micro_loss.backward()
                loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
        for sync in self.grad_syncs:
            sync()
        return loss

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` inside every wrapper a strategy added (outermost first)."""
        with contextlib.ExitStack() as wrappers:
            for wrap in self.step_wrappers:
                wrappers.enter_context(wrap(optimizer))
            if self.update is not None:
                self.update(optimizer)
            else:
                optimizer.step()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameter names as in the unwrapped model (DDP's ``module.`` prefix removed)."""
        for name, parameter in self.module.named_parameters():
            yield name.removeprefix("module."), parameter


def _every_micro_step(last: bool) -> ContextManager[Any]:
    return contextlib.nullcontext()


class Composition:
    """What the strategies build together on one rank; each part's ``apply`` changes it.

    ``estimate_only``: the model lives on the meta device to count its shards'
    bytes; parts shard it as they would, but build nothing that communicates.
    ``plan``: what the model offers the strategies (``zoo.model_protocol``);
    the model itself unless something else speaks for it.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, trainable: Trainable | None, device: torch.device,
                 backend: str, estimate_only: bool = False, whole: Callable[[], nn.Module] | None = None) -> None:
        self.model = model
        # The model is on the meta device, split there by the parts that shard it; ``whole`` builds it
        # whole on rank 0's CPU, to give the pieces their values before a part needs them (``materialize``).
        self.whole = whole
        self.config = config
        self.parts = config.parts
        self.trainable = trainable  # what is trained: how it is called, its loss, what speaks for it
        self.plan = self.plan_for(model)
        self.device = device
        self.backend = backend
        self.estimate_only = estimate_only
        self.grad_syncs: list[Callable[[], None]] = []  # called after backward, in order
        # Context managers around optimizer.step(), given the optimizer.
        self.step_wrappers: list[Callable[[torch.optim.Optimizer], ContextManager[Any]]] = []
        self.after_all: list[Callable[[Composition], None]] = []  # work that needs the final model
        self.runner: Any = None  # runs forward and backward itself (the pipeline's schedule: pp.PipelineRunner)
        # Around each gradient-accumulation micro-step, told whether it is the last: a data-parallel
        # wrapper skips its gradient synchronisation on the others (DDP's no_sync).
        self.micro_step: Callable[[bool], ContextManager[Any]] = _every_micro_step
        # Why torch's DDP reducer cannot hold this model, as parts found it (DTensor parameters, a
        # schedule's several forwards before their backwards): data parallelism averages by hand instead.
        self.reducer_unfit: list[str] = []
        self.own_precision = False  # a part casts for itself (FSDP's policy): no autocast
        self.data_share: tuple[int, int] | None = (0, 1)  # set from the data axes; a part may change it
        self.loss_groups: list[tuple[Any, int]] = []  # (group, size) pairs the progress line's loss is averaged over
        # Replaces optimizer.step() when set (called with the optimizer).
        self.update: Callable[[torch.optim.Optimizer], None] | None = None
        # Replaces forward and backward when set (called with inputs and targets).
        self.forward: Callable[[Batch], torch.Tensor | None] | None = None
        # A part's own state that checkpoints carry beside model and optimizer (DiLoCo's outer step):
        # name -> object with state_dict(app) and load_state_dict(entry, optimizer), see rank/checkpoint;
        # an nbytes() is counted with the optimizer's memory.
        self.extra_state: dict[str, Any] = {}
        # What a part measured during the run, returned with the rank's result: e.g. a parameter
        # server's staleness per update.
        self.strategy_results: dict[str, Any] = {}
        # For verify: given the single-process parameters by name, what this rank holds of them under
        # its own parameters' names (a parameter server's shard is a slice of them); None: the same names.
        self.reference_view: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        # Which batch a step takes, when a part decides it: step -> (batch number, global batch, share index,
        # parts) (DiLoCo across sites: the share the hub gave this round); and whether training is over
        # before the run's steps (the hub has no share left). None: batch ``step``, this rank's data share.
        self.batch_position: Callable[[int], tuple[int, int, int, int]] | None = None
        self.finished: Callable[[], bool] | None = None
        # Whether every rank stands at the same step between forward-backward and the update, where the ranks
        # may agree on something (a loss that is not finite: ``rank.nonfinite``); False for a part whose ranks run
        # ahead of each other by design (an asynchronous parameter server), or whose point is not to communicate
        # every step (DiLoCo: an agreement a step would cross its slow link or the sites' line each step).
        self.lockstep = True

    def uses(self, part: str) -> bool:
        return part in self.parts

    def materialize(self) -> None:
        """Give a model split on the meta device memory and its starting values (``torch_support.meta_init``):
        once, after the parts that shard it, before any part that needs its values."""
        if self.whole is None:
            return
        import torch.distributed as dist

        from labkit.torch_support.meta_init import fill_from_rank0

        whole, self.whole = self.whole, None
        transfer = torch.device("cpu") if "gloo" in self.backend or self.device.type == "cpu" else self.device
        fill_from_rank0(self.model, whole() if dist.get_rank() == 0 else None, self.device, transfer)

    def plan_for(self, model: nn.Module) -> object:
        """What speaks for ``model`` to the parts: the trainable's word for it (a part that replaces the model,
        as a pipeline's stage, asks again)."""
        if self.trainable is None:
            return model
        config = self.config
        rows = None
        if config.global_batch and config.axis("pp") > 1:  # a pipeline cut by tracing runs one real micro-batch
            rows = (config.global_batch, config.global_batch // (config.data_parts * (config.micro_batches or 1)))
        return self.trainable.plan(model, rows)


def _data_axes(composition: Composition, mesh: DeviceMesh) -> None:
    """This rank's share of each batch and the groups its loss is averaged over: the data axes' own."""
    index, parts = 0, 1
    for name in DATA_AXES:
        if name in composition.config.mesh_names and mesh[name].size() > 1:
            index, parts = index * mesh[name].size() + mesh[name].get_local_rank(), parts * mesh[name].size()
            if not composition.estimate_only:
                composition.loss_groups.append((mesh[name].get_group(), mesh[name].size()))
    composition.data_share = (index, parts)


def _compose(composition: Composition, mesh: DeviceMesh) -> Composition:
    _data_axes(composition, mesh)
    for part in sorted(composition.parts, key=lambda name: strategy(name).order):
        entry = strategy(part)
        if not entry.shards_memory:
            composition.materialize()
        rank_module(entry).apply(composition, mesh[entry.axis], composition.config)
    composition.materialize()
    if not composition.estimate_only:
        for finish in composition.after_all:
            finish(composition)
    return composition


def parallelize(model: nn.Module, mesh: DeviceMesh, config: TrainConfig, trainable: Trainable, device: torch.device,
                backend: str, rank: int = 0, whole: Callable[[], nn.Module] | None = None) -> ParallelModel:
    """``model`` (built by ``trainable``) split over ``mesh`` by every part of ``config``'s strategy.

    ``whole``: the model was built on the meta device; this builds it whole on rank 0's CPU, whose values the
    split pieces take once the parts that shard it have applied."""
    composition = _compose(Composition(model, config, trainable, device, backend, whole=whole), mesh)
    autocast = contextlib.nullcontext if composition.own_precision else autocast_for(config.precision, device)
    return ParallelModel(composition, autocast=autocast, role=role_of(config.parts, config, rank))


def shard_for_memory_estimate(model: nn.Module, mesh: DeviceMesh, config: TrainConfig, backend: str,
                              trainable: Trainable | None = None) -> nn.Module:
    """Apply the same sharding to a meta-device model (no memory used); DDP keeps a full copy."""
    composition = Composition(model, config, trainable, torch.device("meta"), backend, estimate_only=True)
    return _compose(composition, mesh).model
