"""Going on after a failure: from the last checkpoint, on ranks the session has already replaced.

When a training run fails without costing a rank (one raised, or was stopped),
the ranks keep their training state: ``surviving_step`` says where it stands, and
``resume=True`` continues it. When a rank was killed, froze or crashed, the
session replaces it and the ranks form a new world, which drops every rank's
training state. What survives is on disk: the run's checkpoints
(``checkpoint_every``/``checkpoint_dir``). ``continuation`` loads the newest one
into the ranks and returns the run that finishes the original one: the same
settings, from the checkpoint's step to the step the original run was to reach.
The steps lost are those since that checkpoint, no more.

``TrainingRun`` uses it by itself with ``auto_heal=True`` (at most
``max_restarts`` times); ``lab.heal()`` uses it after a run that failed without.
The session keeps what it knows of the ranks' training in the records here: a
``TrainingRecord`` of the state they hold, an ``Interrupted`` run to go on with.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from labkit.runs.checkpoints import find_checkpoint, is_complete, read_meta
from labkit.spec.errors import LabConfigError, LabError
from labkit.spec.train_config import TrainConfig

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

POSITION_CALL_SECONDS = 30.0  # asking the ranks where their training state stands


@dataclass(frozen=True)
class TrainingRecord:
    """The notebook's note of the training state the ranks keep: which run, how far, on which group."""

    config: TrainConfig
    steps_done: int  # in all, over the run and its continuations
    generation: int


@dataclass(frozen=True)
class Interrupted:
    """A run that failed before its end: what it was, and how it was being watched."""

    config: TrainConfig
    target_step: int  # the step it was to reach
    failed_at: int | None  # the newest step every rank had finished, when known
    background: bool
    dashboard: bool
    timeout: float
    straggler_threshold: float


def surviving_step(session: Session) -> int | None:
    """After a failed run that cost no rank: the step at which every rank's training state stands, when
    all stopped at the same one outside an optimizer step (the run can be resumed from it); else None."""
    from labkit.wire import entry

    try:
        positions = session.call(range(session.world_size), entry.training_position, (), POSITION_CALL_SECONDS)
    except LabError:
        return None
    if not all(position and position["current"] and not position["updating"] for position in positions):
        return None
    steps = {position["step"] for position in positions}
    return steps.pop() if len(steps) == 1 else None


def has_checkpoint(config: TrainConfig) -> bool:
    directory = config.checkpoint_dir
    if not directory:
        return False
    return any(is_complete(path) for path in glob.glob(os.path.join(directory, "step-*")))


def continuation(session: Session, config: TrainConfig, target_step: int, timeout: float) -> TrainConfig:
    """Load the newest checkpoint of ``config``'s run into the ranks; the run from there to ``target_step``."""
    from labkit.runs.checkpoints import load

    saved_in = config.checkpoint_dir
    if not saved_in or not has_checkpoint(config):
        raise LabConfigError(f"the run saved no checkpoint to go back to (checkpoint_dir {config.checkpoint_dir!r}): "
                             "train again, with checkpoint_every and checkpoint_dir to survive failures")
    directory = find_checkpoint(saved_in)
    step = read_meta(directory)["step"]
    own = {"own": config.own, "model": config.model} if config.own is not None else {}  # sent again as it was
    loaded = load(session, directory, timeout, mesh=dict(zip(config.mesh_names, config.mesh_shape)),
                  say=False, strategy=config.strategy, **own)
    if target_step <= step:
        raise LabConfigError(f"the newest checkpoint ({directory}) is already at step {step}: nothing is left to train")
    # The original run's settings (how it is watched and kept included), from the checkpoint on.
    return replace(config, first_step=step, steps=target_step - step, mesh_reason=loaded.mesh_reason)
