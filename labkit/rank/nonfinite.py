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

On a GPU each loss is looked at where it is made (``LossWatch``): a code for it
is computed on the device and copied to pinned memory behind an event, before
backward is enqueued. The agreement waits for that event, which passes when the
forward has run, while the GPU runs the backward already queued: the GPU never
idles for it (reading the loss after backward would make it wait for the whole
backward, then idle while the CPU enqueues the update and the next forward: 39%
slower steps on a 25M-parameter GPT on an H200). On the host, where a step makes
one loss before its backward (no pipeline, no micro-batches, no strategy's own
forward), the agreement is sent as soon as the loss is made and runs while the
backward does: sent after the backward, it made a DDP step on 4 ranks of 2 cores
27% slower, and sent beside it still 14%. So where gradients are replicated (DDP
alone, on the host) nothing is sent while every loss is finite: a rank whose
loss is not finite makes the gradient leaving its loss NaN, DDP's all-reduce
carries that to every rank's gradients, which are then the same on every rank,
and each rank looks at its own (their sums, one pass): only when they
are not finite do the ranks agree on which loss was not finite. The run's
instruments count the agreement as the lab's traffic, not the model's.

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
    value = float(loss.detach())
    if math.isnan(value):
        return NAN
    if math.isinf(value):
        return INFINITE if value > 0 else NEGATIVE_INFINITE
    return FINITE


def _device_code(loss: torch.Tensor) -> torch.Tensor:
    """``loss_code`` computed where ``loss`` lives, without reading it."""
    value = loss.detach().float()
    return torch.where(torch.isnan(value), NAN,
                       torch.where(torch.isinf(value), torch.where(value > 0, INFINITE, NEGATIVE_INFINITE), FINITE))


class LossWatch:
    """The codes of the losses one step makes (a pipeline's last stage makes one per micro-batch), each taken
    as the loss is made, before its backward is enqueued (``Trainable.loss`` calls ``saw``)."""

    def __init__(self, device: torch.device, agree_early=None, poison: bool = False) -> None:
        """``agree_early(code)``: called on the host with the step's code as soon as its one loss is made, where
        every rank's step makes exactly one before its backward (else None: the code is agreed after it)."""
        self.cuda = device.type == "cuda"
        self.agree_early = None if self.cuda else agree_early
        self.poison = poison and not self.cuda  # a loss not finite makes its gradient NaN (replicated gradients)
        self._slots: list[torch.Tensor] = []  # pinned host codes, reused each step (``take`` waited for them)
        self._events: list[torch.cuda.Event] = []
        self._codes: list[int] = []  # on the host: read at once, the loss is already computed

    def saw(self, loss: torch.Tensor) -> None:
        if not loss.requires_grad:  # not a step's loss (an evaluation under no_grad)
            return
        if not self.cuda:
            self._codes.append(loss_code(loss))
            if self.poison and self._codes[-1]:  # every gradient it reaches is NaN, then every rank's, once synced
                loss.register_hook(lambda gradient: gradient * float("nan"))
            if self.agree_early is not None:
                self.agree_early(self._codes[-1])
            return
        index = len(self._events)
        if index == len(self._slots):
            self._slots.append(torch.zeros((), dtype=torch.int64, pin_memory=True))
        self._slots[index].copy_(_device_code(loss), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events.append(event)

    def take(self, loss: torch.Tensor | None) -> int:
        """This step's code: the first loss that was not finite, else ``FINITE``; a step whose losses were not
        seen (a strategy's own loss path) reads ``loss`` itself."""
        for event in self._events:
            event.synchronize()  # passes once the forward has run: the backward queued after it runs on
        codes = self._codes + [int(slot) for slot in self._slots[:len(self._events)]]
        self._codes, self._events = [], []
        if not codes:
            return loss_code(loss)
        return next((code for code in codes if code), FINITE)


def gradients_finite(gradients: list[torch.Tensor]) -> bool:
    """Whether every element of ``gradients`` is finite, from their sums (one pass: a NaN or an infinity makes its
    sum so). A sum of finite values that overflows says not finite: the ranks then agree on their losses, all
    finite, and the step goes on; a largest-magnitude norm would never err but costs 30 times more on a CPU."""
    if not gradients:
        return True
    return bool(torch.isfinite(torch.stack([gradient.sum(dtype=torch.float32) for gradient in gradients])).all())


class NonFiniteGuard:
    """One run's watch on its losses: whether a step is applied, and what was found."""

    def __init__(self, action: str, lockstep: bool, recorder) -> None:
        self.action = action
        self.agrees = action != "continue" and lockstep
        self.recorder = recorder
        self.found: list[NonFiniteStep] = []  # the steps whose loss was not finite somewhere, as agreed
        self._sent: tuple | None = None  # this step's agreement, sent as its loss was made: (work, codes)

    def send(self, code: int) -> None:
        """Start this step's agreement on ``code`` (this rank's loss); ``check`` waits for it."""
        codes = control_tensor([0.0] * dist.get_world_size())
        codes[dist.get_rank()] = code
        with self.recorder.lab_traffic():  # the lab's agreement, not the model's communication
            work = dist.all_reduce(codes, op=dist.ReduceOp.MAX, async_op=True)
        self._sent = (work, codes)

    def check(self, step_number: int, loss: torch.Tensor | None, watch: LossWatch | None = None,
              replicated_gradients: list[torch.Tensor] | None = None) -> NonFiniteStep | None:
        """Agreed on every rank: the step (numbered as progress lines count it) whose loss was not finite on some
        rank, with those ranks; None when every rank's loss was finite (or nothing is agreed). ``watch``: the
        step's losses as they were made (else ``loss`` is read, after its backward)."""
        if not self.agrees:
            return None
        code = watch.take(loss) if watch is not None else loss_code(loss)
        if replicated_gradients is not None and self._sent is None and gradients_finite(replicated_gradients):
            return None  # the same gradients on every rank, all finite: so was every rank's loss
        if self._sent is None:
            self.send(code)
        assert self._sent is not None
        work, codes = self._sent
        self._sent = None
        work.wait()
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
