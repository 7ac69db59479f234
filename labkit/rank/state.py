"""``TrainState``: what a training run leaves on each rank, and what the next run continues from.

A state is the model as this rank holds it (sharded, wrapped, staged), its
optimizer, how many steps it has taken (which is also the data position: step
``n`` trains on batch ``n`` of the run's seeded data: for a data set, the
samples at positions ``n * global_batch`` onwards of its seeded epochs), the random generators at
the end of the last step, and the formation of the world its communicators
belong to. It lives on the rank between cells (``RankRuntime.train_state``), so
``lab.train(..., resume=True)`` takes up where the last run stopped and ends
with the same parameters as one run of all the steps together. Checkpoints
save and load this object.

A state outlives a rebuild of the process groups in place (after a failed cell:
the groups are handles, ``rank.lab_groups``): the generators are kept at the end
of every step, so a run cut in the middle of one continues as if it had stopped
before it. It does not outlive a new world (a rank replaced, the lab resized),
and a run cut inside an optimizer step leaves it ``updating``: resuming then
says so instead of continuing from half-updated weights.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import numpy
import torch

from labkit.rank.own_model import trainable_for
from labkit.spec.train_config import TrainConfig, resume_differences
from labkit.strategies.catalog import strategy
from labkit.strategies.compose import ParallelModel, parallelize
from labkit.torch_support.trainable import Trainable, initial_network


def random_state() -> dict:
    """Every generator a training step may draw from on this rank."""
    state = {"torch": torch.get_rng_state(), "numpy": numpy.random.get_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_random_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainState:
    """One rank's share of a training run that may continue."""

    config: TrainConfig  # the run that built it (a continuation may change only steps and reporting)
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    mesh: object  # the DeviceMesh its communicators live on
    formation: int  # the generation in which the rank's world was formed: rebuilt in place, the groups stay its own
    trainable: Trainable  # what it trains: builds the network, makes the batches, computes the loss
    step: int = 0  # steps taken in all; the next batch is number ``step``
    updating: bool = False  # inside the optimizer's step: a failure now may leave the weights half updated
    rng: dict = field(default_factory=random_state)

    @property
    def model(self) -> torch.nn.Module:
        return self.parallel.module

    def finish_step(self) -> None:
        self.step += 1
        self.rng = random_state()  # a later run cut short resumes from here, drawing what one run would

    def pause(self) -> None:
        """At the end of a run: remember the generators, so a continuation draws what one run would have."""
        self.rng = random_state()

    def check_continues(self, config: TrainConfig, formation: int) -> None:
        """Refuse a continuation that would not be the same run: another model, mesh, world or position."""
        if formation != self.formation:
            raise RuntimeError(
                f"this rank's training state belongs to the world formed in generation {self.formation}, the ranks "
                f"formed a new one in generation {formation}: the state was lost with it. Train afresh."
            )
        if self.updating:
            raise RuntimeError("the last run was cut inside an optimizer step on this rank, so its weights may be "
                               "half updated: load a checkpoint, or train afresh")
        if config.first_step != self.step:
            raise RuntimeError(f"the notebook resumes at step {config.first_step}, this rank stopped after "
                               f"step {self.step}")
        differences = resume_differences(self.config, config)
        if differences:
            raise RuntimeError(f"cannot continue the last run with other settings: {'; '.join(differences)}")


def build_state(config: TrainConfig, runtime, make_optimizer) -> TrainState:
    """A fresh model on every rank (the same seed everywhere), split by the strategy, with its optimizer."""
    device = runtime.device
    mesh = runtime.mesh_for(config.mesh_shape, config.mesh_names, instrumented=config.instruments)
    trainable = trainable_for(config, runtime)
    whole = None
    if any(strategy(part).shards_memory for part in config.parts) and trainable.builds_on_meta(config.parts):
        # No rank holds the whole network: each builds it on the meta device, the strategy splits it there,
        # and the pieces take their values from one whole build on rank 0's CPU (torch_support.meta_init).
        network = trainable.build(config.seed, "meta")
        whole = functools.partial(initial_network, trainable, config.seed, "cpu")
    else:
        network = initial_network(trainable, config.seed, device)
    parallel = parallelize(network, mesh, config, trainable, device, runtime.backend, runtime.rank, whole=whole)
    optimizer = make_optimizer(parallel.module.parameters(), config, device)
    return TrainState(config, parallel, optimizer, mesh, runtime.formation, trainable)


def state_for(config: TrainConfig, runtime, make_optimizer) -> TrainState:
    """The state a run trains: the rank's own when the run continues one, else a new one (kept on the rank)."""
    if config.first_step:
        state = runtime.train_state
        if state is None:
            raise RuntimeError("this rank has no training state to continue (it was restarted, or never trained): "
                               "train afresh")
        state.check_continues(config, runtime.formation)
        restore_random_state(state.rng)
        return state
    runtime.train_state = None  # the old model's memory goes before the new one is built
    state = build_state(config, runtime, make_optimizer)
    runtime.train_state = state
    return state
