"""Every way of splitting the work, composed by one function in one fixed order.

``parallelize(model, mesh, config)`` applies, in this order and each only if the
strategy asks for it:

1. tensor parallelism on the ``tp`` axis (``tp.apply_tp``): shards layers;
2. pipeline parallelism on the ``pp`` axis (``pp.keep_stage``): keeps this
   rank's stage of layers;
3. data parallelism on the ``dp`` axis: FSDP2 (``fsdp.apply_fsdp``) or DDP
   (``ddp.apply_ddp``, or ``ddp.GradientAllReduce`` next to TP or PP).

The result, a ``ParallelModel``, runs one step's forward and backward for this
rank whatever the composition, so the training loop is the same for all.

Precision: float32 by default (the equivalence proof runs in it). With
``precision="bf16"`` FSDP casts parameters to bfloat16 for compute and reduces
gradients in float32 (its ``MixedPrecisionPolicy``); everything else runs the
forward under ``torch.autocast`` in bfloat16, keeping float32 master weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .ddp import GradientAllReduce, accumulation_context, apply_ddp
from .fsdp import apply_fsdp
from .pp import PipelineRunner, keep_stage
from .tp import apply_tp


def autocast_for(precision: str, device: torch.device, fsdp: bool = False):
    """A context that runs the forward in ``precision``; FSDP's own policy needs none."""
    if precision == "bf16" and not fsdp:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class ParallelModel:
    """This rank's share of the model and how to run a step on it.

    ``backward_watch(loss)`` is entered around each backward pass; the GPU
    instruments set it to note where the device waits for gradient communication.
    """

    def __init__(self, module: nn.Module, loss_fn, micro_batches: int, runner=None, grad_sync=None,
                 autocast=contextlib.nullcontext) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.runner = runner
        self.grad_sync = grad_sync
        self.autocast = autocast
        self.backward_watch = lambda loss: contextlib.nullcontext()

    @property
    def owns_loss(self) -> bool:
        """Whether this rank computes the loss (under PP only the last stage does)."""
        return self.runner is None or self.runner.is_last

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Gradients of the mean loss over this rank's batch; that loss where this rank has it.

        The loss comes back as a 0-d tensor on the rank's device: reading it
        (``float``) would make the CPU wait for the GPU every step.
        """
        if self.runner is not None:
            with self.autocast():
                loss = self.runner.step(inputs, targets)
        else:
            loss = None
            pairs = list(zip(inputs.chunk(self.micro_batches), targets.chunk(self.micro_batches)))
            for index, (micro_inputs, micro_targets) in enumerate(pairs):
                last = index == len(pairs) - 1
                with _micro_step(self.module, last):
                    with self.autocast():
                        micro_loss = self.loss_fn(self.module(micro_inputs), micro_targets) / len(pairs)
                    with self.backward_watch(micro_loss):
                        micro_loss.backward()
                loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
        if self.grad_sync is not None:
            self.grad_sync()
        return loss

    def named_parameters(self):
        """Parameter names as in the unwrapped model (DDP's ``module.`` prefix removed)."""
        for name, parameter in self.module.named_parameters():
            yield name.removeprefix("module."), parameter


def _micro_step(module: nn.Module, last: bool):
    """Skip gradient synchronisation on accumulation micro-steps (DDP and FSDP)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return accumulation_context(module, last)


def parallelize(model: nn.Module, mesh, config, loss_fn, device: torch.device, backend: str) -> ParallelModel:
    parts = config.parts
    if "tp" in parts:
        apply_tp(model, mesh["tp"], config.sequence_parallel)
    if "pp" in parts:
        keep_stage(model, mesh["pp"])
    grad_sync = None
    if "fsdp" in parts:
        apply_fsdp(model, mesh["dp"], config.reshard_after_forward, backend, config.precision)
    elif "ddp" in parts:
        if "tp" in parts or "pp" in parts:
            grad_sync = GradientAllReduce([model], mesh["dp"])
        else:
            model = apply_ddp(model, mesh["dp"], config.bucket_cap_mb)
    runner = None
    if "pp" in parts:
        runner = PipelineRunner(model, mesh["pp"], config.schedule, config.micro_batches, loss_fn, device)
    autocast = autocast_for(config.precision, device, fsdp="fsdp" in parts)
    return ParallelModel(model, loss_fn, config.micro_batches, runner=runner, grad_sync=grad_sync, autocast=autocast)


def shard_for_memory_estimate(model: nn.Module, mesh, config, backend: str) -> nn.Module:
    """Apply the same TP / PP / FSDP sharding to a meta-device model (no memory used).

    DDP keeps a full copy, so it needs no wrapping to be counted.
    """
    parts = config.parts
    if "tp" in parts:
        apply_tp(model, mesh["tp"], config.sequence_parallel)
    if "pp" in parts:
        keep_stage(model, mesh["pp"])
    if "fsdp" in parts:
        apply_fsdp(model, mesh["dp"], config.reshard_after_forward, backend, config.precision)
    return model
