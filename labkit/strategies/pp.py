"""Pipeline parallelism with ``torch.distributed.pipelining``: layers split into stages.

Each rank of the pp axis keeps a contiguous run of layers (``keep_stage``) and
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
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def keep_stage(model: nn.Module, pp_mesh) -> int:
    """Cut ``model`` down to this rank's stage; return the stage index."""
    stage = pp_mesh.get_local_rank()
    model.keep_stage(stage, pp_mesh.size())
    return stage


class PipelineRunner:
    """Runs one training step of a pipeline stage: forward and backward of every microbatch."""

    def __init__(self, module: nn.Module, pp_mesh, schedule: str, microbatches: int, loss_fn, device) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
        self.stage_index = pp_mesh.get_local_rank()
        self.stages = pp_mesh.size()
        self.group = pp_mesh.get_group()
        self.device = device
        self.stage = PipelineStage(module, self.stage_index, self.stages, device, group=self.group)
        self.schedule = SCHEDULES[schedule](self.stage, n_microbatches=microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the step's batch; the mean loss on the last stage (a 0-d tensor)."""
        losses: list[torch.Tensor] = []
        batched = getattr(self.group, "p2p_batched", None)  # a lab group; torch's own coalesces by itself
        with batched(self.device) if batched is not None else contextlib.nullcontext():
            self._run_schedule(inputs, targets, losses)
        if not losses:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _run_schedule(self, inputs, targets, losses: list) -> None:
        if self.is_first and self.is_last:
            self.schedule.step(inputs, target=targets, losses=losses)
        elif self.is_first:
            self.schedule.step(inputs)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()


def apply(composition, pp_mesh, config) -> None:
    """Catalog entry point: keep this rank's stage; the schedule runs the final (maybe DDP/FSDP) model."""
    keep_stage(composition.model, pp_mesh)

    def build_runner(done) -> None:
        done.runner = PipelineRunner(done.model, pp_mesh, config.schedule, config.micro_batches, done.loss_fn,
                                     done.device)

    composition.after_all.append(build_runner)
