"""A loss that is NaN or infinite, caught at its step on every rank (``TrainConfig.on_nonfinite``).

After each step's forward and backward, before the optimizer's update, the ranks
agree whether any rank's loss is not finite: one all-reduce of one small number
per rank (what its loss was: finite, nan, inf or -inf). Agreeing is what lets
every rank act at the same step: a rank that stopped alone would leave the others
waiting in the next collective.

- ``stop`` (the default): no rank applies the step, and the run ends there. The
  model and the optimizer keep what they were after the last finite step (its
  gradients are dropped at the next step's start), so ``resume=True`` continues
  from it, and the notebook names the step, the ranks and the last finite loss.
- ``skip``: no rank applies that step's update; the data moves on to the next
  batch and the run goes on; the report lists the skipped steps.
- ``continue``: nothing is agreed (no collective); the notebook warns once.

Reading whether a loss is finite makes the CPU wait for a GPU to finish the
step's backward (torch's ``GradScaler`` waits the same way at every step); the
run's instruments count the agreement as the lab's traffic, not the model's.

A strategy whose ranks never stand at one step together (an asynchronous
parameter server: ``ParallelModel.lockstep`` is False) agrees nothing, since
agreeing every step would end its asynchrony: its run goes on as under
``continue``, and the notebook warns.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.rank.lab_traffic import control_tensor
from labkit.wire.schema import NonFiniteStep

FINITE, NAN, INFINITE, NEGATIVE_INFINITE = 0, 1, 2, 3
VALUE_NAMES = {NAN: "nan", INFINITE: "inf", NEGATIVE_INFINITE: "-inf"}


def loss_code(loss: torch.Tensor | None) -> int:
    """What this rank's loss is, as a code: ``FINITE`` also for a rank that computes none (a pipeline's
    earlier stage, a parameter server's server)."""
    if loss is None:
        return FINITE
    value = float(loss)
    if math.isnan(value):
        return NAN
    if math.isinf(value):
        return INFINITE if value > 0 else NEGATIVE_INFINITE
    return FINITE


class NonFiniteGuard:
    """One run's watch on its losses: whether a step is applied, and what was found."""

    def __init__(self, action: str, lockstep: bool, recorder) -> None:
        self.action = action
        self.agrees = action != "continue" and lockstep
        self.recorder = recorder
        self.found: list[NonFiniteStep] = []  # the steps whose loss was not finite somewhere, as agreed

    def check(self, step_number: int, loss: torch.Tensor | None) -> NonFiniteStep | None:
        """Agreed on every rank: the step (numbered as progress lines count it) whose loss was not finite on some
        rank, with those ranks; None when every rank's loss was finite (or nothing is agreed)."""
        if not self.agrees:
            return None
        codes = control_tensor([0.0] * dist.get_world_size())
        codes[dist.get_rank()] = loss_code(loss)
        with self.recorder.lab_traffic():  # the lab's agreement, not the model's communication
            dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        found = [(rank, int(code)) for rank, code in enumerate(codes.tolist()) if code]
        if not found:
            return None
        event: NonFiniteStep = {"step": step_number, "ranks": [rank for rank, _ in found],
                                "values": [VALUE_NAMES[code] for _, code in found]}
        self.found.append(event)
        return event

    @property
    def stops(self) -> bool:
        """Whether a step found not finite ends the run (else its update is skipped)."""
        return self.action == "stop"
