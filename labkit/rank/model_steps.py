"""DDP and FSDP2 models built in earlier cells stay in step across a cell that failed on some ranks.

Runs in the engines. torch's DistributedDataParallel keeps per-iteration state in its reducer, and each
rank's copy moves only as far as that rank got:

- the iteration count (static graph treats its first iteration apart: it counts which parameters
  get gradients and reduces everything at the end of that backward);
- the bucket rebuild: the first backward records the order gradients arrive in, and the next forward
  rebuilds the buckets in that order, after rank 0 broadcasts it (a collective, once per model);
- a reduction that a backward began (``Expected to have finished reduction in the prior iteration``).

When one rank raised before its backward while the others ran theirs, the others recorded an order and
the next forward broadcasts it on their side only: the ranks call different collectives. So before each
model's first forward in a piece of work this rank notes where the model stood (``ModelSteps``), and
after failed work the notebook asks every rank to put every model back where all ranks agree it
stood, the same way on each (``put_in_step``):

- buckets rebuilt (on every rank alike): the rebuild is forgotten and done again after the next
  backward, in the order gradients arrive, which is the layout the buckets have: the same sums follow;
- a static-graph model that had not finished an iteration: the reducer it was built with again;
- a backward ran on this rank in the failed work: what it recorded is forgotten (a backward cannot
  have run while an earlier recorded order waited to be broadcast: the forward broadcasts it first);
- otherwise the model stays as it was.

The forward's buffer synchronization (``require_forward_param_sync``) goes back to what it was.

A Ctrl-C in the notebook while a ``%%lab`` cell trains a DDP model asks the ranks, through the control
channel, to stop before their next DDP forward (``StopRequested``): between two iterations, where every
rank has applied the same optimizer steps. A rank that had gone on into the next iteration waits in its
first collective for the ones that stopped and is released (the deadlock watch): it applied no more
steps than they did. Signals, which land anywhere (one rank past its optimizer step, another not), come
only when no rank reached a forward within the grace.

FSDP2 keeps its iteration in Python: training states, the module that began the forward, the order
modules ran for backward's prefetch, pending reduce-scatters, parameters left unsharded. torch's own
recovery (``FSDPModule.reset_iter_state``) puts all of it as before an iteration, on every rank, and
the failed iteration's gradients in flight are dropped.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch

from labkit.torch_support.torch_internals_models import (
    ddp_has_own_reducer,
    ddp_iteration_state,
    ddp_reducer_settled,
    fresh_ddp_reducer,
    fsdp_roots,
    reset_ddp_reducer,
    reset_fsdp_iteration,
    watch_ddp_forwards,
)


@dataclass(frozen=True)
class Standing:
    """Where one DDP model stood before its first forward in a piece of work."""

    work: int
    iterations: int  # forwards that began an iteration (with gradients, synchronizing them)
    rebuilt: bool  # its buckets were rebuilt in the order gradients arrive
    marked: tuple[int, ...]  # when each gradient was last marked ready (changes when a backward runs)
    forward_param_sync: bool


class StopBeforeIteration(KeyboardInterrupt):
    """The notebook asked a cell to stop (Ctrl-C): raised as a DDP model's forward begins, before the
    iteration does anything."""


class ModelSteps:
    """This rank's DDP and FSDP2 models: where each DDP model stood as the current work reached it, and how
    to put every model back after failed work."""

    def __init__(self) -> None:
        self.work = 0  # numbers the pieces of user work this rank ran
        self.iterating = False  # a DDP forward ran in the current work
        self._stop_channel = None  # the control channel a stop before the next iteration comes through
        self._iterations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._standing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        watch_ddp_forwards(self._before_forward)

    def begin_work(self, stop_channel=None) -> None:
        """A piece of user work begins; ``stop_channel`` (``rank.control.ControlChannel``): a stop the notebook
        asks for through it is raised before the next DDP forward (None: none is)."""
        self.work += 1
        self.iterating = False
        self._stop_channel = stop_channel

    def _before_forward(self, model) -> None:
        if not ddp_has_own_reducer(model):
            return
        channel = self._stop_channel
        if channel is not None:
            channel.poll()  # a round trip to the store at most every few hundredths of a second
            if channel.stop_requested:
                raise StopBeforeIteration("the notebook asked the cell to stop: this rank stopped as a forward of "
                                          f"{type(model.module).__name__} (DDP) began, between two iterations")
        self.iterating = True
        iterations = self._iterations.get(model, 0)
        standing = self._standing.get(model)
        if standing is None or standing.work != self.work:  # its first forward in this work: where it stands
            rebuilt, marked = ddp_iteration_state(model)
            self._standing[model] = Standing(self.work, iterations, rebuilt, marked,
                                             bool(model.require_forward_param_sync))
        began = torch.is_grad_enabled() and model.require_backward_grad_sync  # an iteration, as its reducer counts
        self._iterations[model] = iterations + 1 if began else iterations

    def put_in_step(self, failed_here: bool) -> list[str]:
        """After failed work, every model as the other ranks put theirs (``failed_here``: this rank ran that
        work, else it ran none since its last). What was done, in words (for tests and the log)."""
        return self._ddp_in_step(failed_here) + self._fsdp_in_step()

    def _fsdp_in_step(self) -> list[str]:
        done = []
        # Objects made since the engine started (the rest is frozen out of the collector's lists).
        for root in fsdp_roots(gc.get_objects()):
            done.append(f"{type(root).__name__}: " + ("iteration reset" if reset_fsdp_iteration(root) else
                                                      "left as it was (this torch cannot reset it)"))
        return done

    def _ddp_in_step(self, failed_here: bool) -> list[str]:
        done = []
        for model, iterations in list(self._iterations.items()):
            if not ddp_has_own_reducer(model):
                continue
            rebuilt, marked = ddp_iteration_state(model)
            standing = self._standing.get(model)
            if standing is None or not failed_here or standing.work != self.work:
                standing = Standing(self.work, iterations, rebuilt, marked, bool(model.require_forward_param_sync))
            model.require_forward_param_sync = standing.forward_param_sync
            if rebuilt:
                reset_ddp_reducer(model)
                done.append("rebuild forgotten")
            elif model.static_graph and standing.iterations == 0:
                fresh_ddp_reducer(model)
                self._iterations[model] = 0
                done.append("reducer as built")
            elif marked != standing.marked or not ddp_reducer_settled(model):
                reset_ddp_reducer(model)
                done.append("backward forgotten")
            else:
                done.append("kept")
        return done
