"""Instruments on a training loop the lab did not write: a torchrun script or a ``%%lab`` cell.

``LoopWatch`` makes the same rows as ``lab.train``'s instruments (``recorder``) for
code that calls none of the lab's methods. What it sees, and where:

- **Steps.** A step ends where the user's optimizer steps: torch's global hooks
  see every ``Optimizer.step()``, whatever the optimizer. An optimizer stepping
  inside another's step (ZeRO's inner optimizer) is part of the outer one. A
  loop with several optimizer steps per step, or none, marks its steps with
  ``labkit.step()`` (``loop_marks``); from the first such mark on, optimizer steps
  no longer end steps. The first step begins at the first forward of the
  data-parallel module (or the first optimizer step, when there is none), not
  when the script starts: building the model is not a step.
- **Samples and tokens.** From the batch given to the data-parallel module (the
  outermost DDP, FSDP or ``fully_shard`` module whose forward runs): its first
  tensor argument's rows, and its elements as tokens when it is 2-D integer
  data, summed over the forwards of a step that track gradients; where tensor- or
  pipeline-parallel peers take the same rows, each counts its share (``replica_copies``),
  so ranks together count each replica's batch once. The module is
  found by a global forward hook during the first step only; afterwards only
  that module carries a hook. Without one, rows count steps alone (said once).
- **Collectives.** Every group of the rank reports to the recorder while the
  loop is watched (``LabGroups.recording_into``), the groups the loop makes too.
- **Loss and scalars.** ``labkit.log(loss=..., **scalars)`` adds them to the
  step's row; nothing is guessed.
- **Requests.** ``%lab slow`` is spent at the start of each step (so it shows in
  the step, as under ``lab.train``); a stop requested by the notebook is agreed by
  all ranks every ``STOP_CHECK_EVERY`` steps and raised at that step boundary as
  ``StopRequested``, which the loop may catch (to save, say). Only a stoppable
  watch agrees; one that is not adds no collective at all.

Nothing here changes the numbers the loop computes: hooks read shapes and
clocks, never tensors' values.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from labkit.rank.control import ControlChannel
from labkit.rank.instruments.recorder import Publisher
from labkit.rank.instruments.run_instruments import STOP_CHECK_EVERY, _agree_to_stop
from labkit.rank.memory import memory_bytes
from labkit.torch_support.torch_internals_models import data_parallel_size


MEMORY_EVERY = 2.0  # seconds between two counts of what the loop holds, for the dashboard
NO_STEP_NOTE = ("no step was seen: no optimizer stepped and no labkit.step() marked one; a loop that updates "
                "its weights another way marks each step with `with labkit.step(samples=len(batch)):`")


class StopRequested(KeyboardInterrupt):
    """The notebook asked the watched loop to stop; raised on every rank at the same step boundary."""


def _data_parallel(module: torch.nn.Module) -> bool:
    """Whether ``module`` wraps a model for data parallelism: its forward sees the rank's batch."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, (DistributedDataParallel, FSDPModule)):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every torch the lab supports has it
        return False
    return isinstance(module, FullyShardedDataParallel)


def replica_copies(module: torch.nn.Module) -> int:
    """How many ranks see the batch this rank's data-parallel ``module`` sees: the world over the ranks that
    split the data (2 under fsdp x tp=2, where both tensor-parallel ranks take the same rows); 1 when unknown."""
    import torch.distributed as dist

    size = data_parallel_size(module)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world // size if size and world % size == 0 else 1


def batch_size(args: tuple, kwargs: dict) -> tuple[int, int | None] | None:
    """(samples, tokens or None) of the first tensor among ``args`` then ``kwargs``; None without one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            tokens = value.numel() if value.dim() == 2 and not value.is_floating_point() \
                and not value.is_complex() and value.dtype != torch.bool else None
            return value.shape[0], tokens
    return None


class LoopWatch:
    """One watched run of user code on this rank: rows, their publishing, the notebook's requests."""

    def __init__(self, runtime, stoppable: bool = False) -> None:
        self.runtime = runtime
        self.recorder = runtime.recorder
        self.stoppable = stoppable
        self.publisher = Publisher(self.recorder, memory=self._held)
        device = runtime.device
        delay = runtime.link.stream_delay(device) if device.type == "cuda" else None
        self.control = ControlChannel(runtime.store, runtime.rank, stream_delay=delay)
        self.step: int | None = None  # the step under way; None before the first
        self.steps_done = 0
        self.explicit = False  # labkit.step() marks the steps: optimizer steps no longer do
        self.samples = 0
        self.tokens: int | None = None
        # Ranks that see this rank's batch, itself included (its tensor- and pipeline-parallel peers): each
        # counts its share, so the step's batch is counted once per data-parallel replica.
        self.copies = 1
        self.loss: Any = None  # what labkit.log gave: a number, or a tensor read once its step has passed
        self.scalars: dict[str, float] = {}
        self.delay = 0.0
        self.module: torch.nn.Module | None = None  # the data-parallel module found
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self._optimizer_depth = 0
        self._hooks: list = []
        self._finder: Any = None  # the global forward hook that looks for the data-parallel module
        self._notes: list[str] = []
        self.stopped = False  # a stop the notebook asked for was raised in the loop
        self._held_at = float("-inf")  # when what the loop holds was last counted
        self._held_bytes: dict | None = None

    # -- the run ------------------------------------------------------------

    def __enter__(self) -> "LoopWatch":
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.recorder.clear()
        self._recording = self.runtime.groups.recording_into(self.recorder)
        self._recording.__enter__()
        self._hooks += [register_optimizer_step_pre_hook(self._optimizer_begins),
                        register_optimizer_step_post_hook(self._optimizer_ended)]
        self._finder = register_module_forward_pre_hook(self._look_for_data_parallel)
        self.runtime.loop_watch = self
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.loop_watch = None
        for hook in [*self._hooks, self._finder]:
            if hook is not None:
                hook.remove()
        self._hooks, self._finder = [], None
        self._recording.__exit__(None, None, None)
        self.recorder.finish()
        self.publisher.maybe_publish(force=True)

    def _held(self) -> dict | None:
        """What the loop holds now, for the dashboard: counted at most every ``MEMORY_EVERY`` seconds (it walks
        every parameter and optimizer state); None until the data-parallel module is found."""
        now = time.monotonic()
        if self.module is not None and now >= self._held_at + MEMORY_EVERY:
            self._held_at, self._held_bytes = now, self.memory()
        return self._held_bytes

    def memory(self) -> dict:
        """Parameters and gradients of the data-parallel module (local shards), and every stepped optimizer's state."""
        held = memory_bytes(self.module, None) if self.module is not None else {"params": 0, "grads": 0,
                                                                               "optimizer": 0}
        for optimizer in self.optimizers.values():
            held["optimizer"] += memory_bytes(torch.nn.Module(), optimizer)["optimizer"]
        return held

    def result(self) -> dict:  # a LoopResult without its "value" (the work's, added by the runtime)
        """What the notebook's report is made of: rows, timeline, memory, and what could not be seen."""
        notes = list(self._notes)
        if self.module is None and self.steps_done:
            notes.append("no DDP or FSDP module ran a forward: steps are counted, samples are not")
        if not self.steps_done:
            notes.append(NO_STEP_NOTE)
        return {"rank": self.runtime.rank, "rows": list(self.recorder.rows), "timeline": list(self.recorder.timeline),
                "memory": self.memory(), "steps_done": self.steps_done, "notes": notes,
                "found": type(self.module).__name__ if self.module is not None else None, "stopped": self.stopped}

    # -- steps ----------------------------------------------------------------

    def begin(self) -> None:
        """A step begins: its row opens, and an injected slowdown is spent inside it."""
        self.step = self.steps_done
        self.samples, self.tokens, self.loss, self.scalars = 0, None, None, {}
        self.recorder.begin_step(self.step)
        self.control.poll()
        self.delay = self.control.spend_delay()

    def end(self) -> None:
        """The step under way ends: its row is made and published; a stop agreed here is raised."""
        if self.step is None:
            return
        self._stop_looking()  # a data-parallel module runs its forward in the first step, or there is none
        copies = self.copies
        tokens = None if self.tokens is None else self.tokens / copies if copies > 1 else self.tokens
        self.recorder.end_step(self.samples / copies if copies > 1 else self.samples, tokens, self.loss, self.delay)
        if self.scalars and self.recorder.rows:
            self.recorder.rows[-1]["scalars"] = dict(self.scalars)
        self.publisher.maybe_publish()
        self.step = None
        self.steps_done += 1
        if self.stoppable and self.steps_done % STOP_CHECK_EVERY == 0:
            self.control.poll()
            with self.recorder.lab_traffic():  # the lab's agreement is not the loop's traffic
                stop = _agree_to_stop(self.control.stop_requested)
            if stop:
                self.stopped = True
                raise StopRequested(f"the notebook asked this loop to stop; every rank stopped after step "
                                    f"{self.steps_done}")

    @contextlib.contextmanager
    def marked_step(self, samples: int | None = None, tokens: int | None = None):
        """``labkit.step()``: the block is one step; optimizer steps inside it do not end steps."""
        if not self.explicit:
            self.explicit = True
            self.step = None  # an automatic step under way is dropped: the marks say where steps are
        self.begin()
        yield
        if samples is not None:
            self.samples = samples
        if tokens is not None:
            self.tokens = tokens
        self.end()

    def log(self, scalars: dict[str, Any]) -> None:
        """``labkit.log``: the loss goes to the row's loss (a GPU tensor is read once its step has passed);
        other values to its scalars."""
        for name, value in scalars.items():
            if name == "loss":
                self.loss = value.detach() if isinstance(value, torch.Tensor) else value
                continue
            self.scalars[name] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

    # -- hooks ----------------------------------------------------------------

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        self._optimizer_depth += 1
        self.optimizers.setdefault(id(optimizer), optimizer)
        if self._optimizer_depth == 1 and not self.explicit and self.step is None:
            self.begin()  # a loop without a data-parallel module: its first step starts here

    def _optimizer_ended(self, optimizer, args, kwargs) -> None:
        self._optimizer_depth -= 1
        if self._optimizer_depth or self.explicit:
            return
        self.end()
        self.begin()

    def _look_for_data_parallel(self, module, args) -> None:
        if self.module is None and _data_parallel(module):
            self.module = module
            self.copies = replica_copies(module)
            self._hooks.append(module.register_forward_pre_hook(self._forward, with_kwargs=True))
            self._stop_looking()
            self._forward(module, args, {})

    def _stop_looking(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None

    def _forward(self, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation between steps is not training
        if self.step is None and not self.explicit:
            self.begin()
        seen = batch_size(args, kwargs)
        if seen is None:
            return
        rows, tokens = seen
        self.samples += rows
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens


def current_watch():
    """The loop watch of this rank's user work, or None (not in a lab rank, or not watched)."""
    import sys

    if "IPython" not in sys.modules:  # a plain process (torchrun): no lab here
        return None
    from IPython import get_ipython

    from labkit.wire.current import RUNTIME_NAME

    shell = get_ipython()
    runtime = shell.user_ns.get(RUNTIME_NAME) if shell is not None else None
    return getattr(runtime, "loop_watch", None)

