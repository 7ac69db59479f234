"""Pipeline parallelism with ``torch.distributed.pipelining``: layers split into stages.

Each rank of the pp axis keeps a contiguous run of layers (the model's
``keep_stage``, ``zoo.model_protocol``; its settings may refuse more stages
than layers in the notebook, ``check_stages``) and
passes activations forward and gradients backward to its neighbours. A step's
batch is cut into ``microbatches`` so that stages can work at the same time:

- GPipe runs every microbatch forward, then every one backward: simple, but each
  stage holds all microbatches' activations and idles while the pipe fills and
  drains (the "bubble", (stages - 1) / (microbatches + stages - 1) of the step);
- 1F1B alternates one forward and one backward once the pipe is full: the same
  bubble, but at most ``stages`` microbatches of activations in flight.

The schedule averages gradients over microbatches (``scale_grads``), so a step
equals one step on the whole batch.

nccl pitfall: a send is a kernel that ends only once the peer receives, so two
neighbouring stages that each send before they receive would block each other;
torch posts each batch of sends and receives as one nccl group, but not through
the lab's timed group (a Python subclass). The step runs with the group's
``p2p_batched``, which posts them together as torch would (``rank.instruments.p2p_batch``).

gloo pitfall (pytorch#132644): the schedules send and receive with
``batch_isend_irecv``, which used to hang on gloo because only one of gloo's
several work handles was waited on. The torch versions labkit supports carry the
fix; the pipeline tests run GPipe and 1F1B on gloo, and every cell is bounded by
the lab's timeout in any case.

The declaration loads without torch; ``apply`` and the runner import it on the ranks.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

from labkit.strategies.catalog import Setting, SettingValueError, Strategy
from labkit.zoo.model_protocol import ChecksStages, SplitsIntoStages, SplitsByTracing

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

SCHEDULE = Setting("schedule", "1f1b", "pipeline schedule", choices=("gpipe", "1f1b"))
SCHEDULES = ("gpipe", "1f1b")


def check(config: TrainConfig) -> None:
    """More stages than the model can be cut into, or too few microbatches for 1F1B, refused in the notebook."""
    stages = config.axis("pp")
    settings = config.model_config
    if isinstance(settings, ChecksStages):
        settings.check_stages(stages)
    micro_batches = config.micro_batches or 1
    if config.setting(SCHEDULE) == "1f1b" and micro_batches < stages:
        raise SettingValueError(
            f"1F1B needs at least as many microbatches as stages: micro_batches={micro_batches} is fewer than the "
            f"{stages} stages; pass micro_batches={stages} or more (left out, it is the number of stages), or "
            "schedule='gpipe'")


def one_microbatch_per_stage(config: TrainConfig) -> dict[str, int]:
    return {"micro_batches": config.axis("pp")}


STRATEGY = Strategy(
    "pp", axis="pp", order=1, shards_memory=True, check=check, defaults=one_microbatch_per_stage,
    loss_on_one_rank=True, list_position=40,
    summary="pipeline parallel: stages of layers, microbatches in flight (torch.distributed.pipelining)",
    settings=(SCHEDULE,),
    model_options=("pp_split",),
)


def keep_stage(model: nn.Module, pp_mesh: DeviceMesh, plan: object | None = None) -> nn.Module:
    """This rank's stage of ``model``: the model cut down in place (``keep_stage``), or a module of its own
    made by tracing it (``split_stage``), by what ``plan`` (or the model) offers."""
    offered = model if plan is None else plan
    if not isinstance(offered, (SplitsByTracing, SplitsIntoStages)):
        raise TypeError(f"no pipeline stages for {type(model).__name__}: give it a keep_stage(stage, stages) "
                        "method that drops the layers other stages own, keeping the names of the rest")
    stage, stages = pp_mesh.get_local_rank(), pp_mesh.size()
    if isinstance(offered, SplitsByTracing):
        return offered.split_stage(stage, stages)
    offered.keep_stage(stage, stages)
    return model


def _schedule_class(schedule: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]


class PipelineRunner:
    """Runs one training step of a pipeline stage: forward and backward of every microbatch."""

    def __init__(self, module: nn.Module, pp_mesh: DeviceMesh, schedule: str, microbatches: int,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
        self.stage_index = pp_mesh.get_local_rank()
        self.stages = pp_mesh.size()
        self.group = pp_mesh.get_group()
        self.device = device
        self.stage = PipelineStage(module, self.stage_index, self.stages, device, group=self.group)
        self.schedule = _schedule_class(schedule)(self.stage, n_microbatches=microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    def step(self, batch: Any) -> torch.Tensor | None:
        """Forward and backward of the step's batch (inputs, targets); the mean loss on the last stage (a 0-d
        tensor)."""
        import torch

        from labkit.torch_support.batches import model_call, targets_of

        args, keywords = model_call(batch)
        if keywords:
            raise TypeError("a pipeline passes one stage's outputs to the next as tensors: give batches as "
                            "(inputs, targets) tuples, not dicts")
        targets = targets_of(batch) if self.is_last else None
        losses: list[torch.Tensor] = []
        batched = getattr(self.group, "p2p_batched", None)  # a lab group; torch's own coalesces by itself
        with batched(self.device) if batched is not None else contextlib.nullcontext():
            self._run_schedule(tuple(args), targets, losses)
        if not losses:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _run_schedule(self, inputs: tuple, targets: torch.Tensor | None, losses: list[torch.Tensor]) -> None:
        """``inputs``: the first stage's positional arguments (a model of several inputs takes them all)."""
        if self.is_first and self.is_last:
            self.schedule.step(*inputs, target=targets, losses=losses)
        elif self.is_first:
            self.schedule.step(*inputs)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()


def apply(composition: Composition, pp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Keep this rank's stage; the schedule runs the final (maybe DDP/FSDP) model, once every part applied.

    A schedule runs several forwards before their backwards, which torch's DDP reducer rejects."""
    stage = keep_stage(composition.model, pp_mesh, plan=composition.plan)
    if stage is not composition.model:  # a stage of its own: the parts after this one split that
        composition.model = stage
        composition.plan = composition.plan_for(stage)
    composition.reducer_unfit.append("a pipeline schedule's several forwards before their backwards")
    schedule, microbatches = config.setting(SCHEDULE), config.micro_batches or 1

    def build_runner(done: Composition) -> None:
        trainable = done.trainable
        # What speaks for a traced stage rebuilds the network's own output (a Hugging Face ModelOutput).
        rebuild = getattr(done.plan, "stage_output", lambda output: output)
        # The last stage has the targets only: the loss sees (None, targets) as its batch.
        loss = (lambda output, targets: trainable.loss(rebuild(output), (None, targets))) \
            if trainable is not None else None
        done.runner = PipelineRunner(done.model, pp_mesh, schedule, microbatches, loss, done.device)

    composition.after_all.append(build_runner)
