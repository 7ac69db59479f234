"""Save and load the ranks' training state: ``lab.save(path)``, ``lab.load(path)``, ``%lab checkpoint``.

A checkpoint is a directory written by ``labkit.rank.checkpoint`` (torch.distributed.
checkpoint shards, every rank's random state, and ``labkit.json`` with the run's
settings, written last). A directory of checkpoints (``checkpoint_dir``, one
``step-NNNNNNNN`` each) loads its newest complete one; partial ones are ignored.

Loading builds the model the checkpoint holds, under the lab's ranks and the
strategy asked for (by default the saved one), and DCP reshards it: saved on 4
ranks, loaded on 2. A checkpoint of another model than the one asked for is
refused, saying what differs. After a load, ``lab.train(steps=..., resume=True)``
continues from the checkpoint's step.
"""

from __future__ import annotations

import glob
import json
import os
import uuid

from labkit.rank import entry
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import TrainConfig, checkpoint_settings, identity_differences, resolve
from labkit.strategies.catalog import checkpoint_refusal

META_FILE = "labkit.json"  # the rank side writes it last: its presence marks a complete checkpoint
STEP_PATTERN = "step-*"


def step_directory(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def partial_directory(target: str) -> str:
    """Where a save writes before it is complete: beside the target, never mistaken for it."""
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".partial-{name}-{uuid.uuid4().hex[:8]}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META_FILE)) as handle:
        return json.load(handle)


def find_checkpoint(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete checkpoint inside it."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_complete(path):
        return path
    found = sorted(candidate for candidate in glob.glob(os.path.join(path, STEP_PATTERN)) if is_complete(candidate))
    if found:
        return found[-1]
    if not os.path.isdir(path):
        raise LabConfigError(f"no checkpoint at {path}: the path does not exist")
    raise LabConfigError(f"no complete checkpoint in {path} (partial saves, if any, are ignored): "
                         "save one with lab.save(path), or train with checkpoint_every and checkpoint_dir")


def save(session, path: str, timeout: float) -> str:
    """Save the training state the ranks hold into the directory ``path``; return its full path."""
    record = session.last_training
    if record is None:
        raise LabConfigError("there is no training state to save: train first (lab.train), or load a checkpoint; "
                             "a failure or restart since the last run drops the ranks' state")
    if checkpoint_refusal(record.config.parts):
        raise LabConfigError(f"cannot save the last run: {checkpoint_refusal(record.config.parts)}")
    target = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    meta = checkpoint_settings(record.config)
    session.execute(session.targets(None), entry.save_checkpoint, (target, partial_directory(target), meta), timeout)
    return target


def _normalised(settings: dict) -> dict:
    model_settings = settings.get("model_settings") or {}
    return {**settings, "model_settings": {key: tuple(value) if isinstance(value, list) else value
                                           for key, value in model_settings.items()}}


def load(session, path: str, timeout: float, mesh: dict | None = None, **overrides) -> TrainConfig:
    """Load the checkpoint at ``path`` into the ranks (resharded to them); return the run's config."""
    directory = find_checkpoint(path)
    meta = read_meta(directory)
    saved = _normalised(meta["settings"])
    differences = identity_differences(saved, overrides)
    if differences:
        raise LabConfigError(f"the checkpoint {directory} holds another model: {'; '.join(differences)}. "
                             "Load it as it was saved, or train the other model afresh")
    same_world = meta["world_size"] == session.world_size
    if "strategy" in overrides and overrides["strategy"] != saved["strategy"]:
        saved = {key: value for key, value in saved.items() if key in TrainConfig.__dataclass_fields__}
    if mesh is None and same_world and overrides.get("strategy", saved["strategy"]) == saved["strategy"]:
        mesh = meta.get("mesh") or None
    try:
        config = resolve(session.world_size, mesh=mesh, lab_mesh=session.mesh_spec, **{**saved, **overrides})
    except LabConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise LabConfigError(f"the checkpoint cannot be loaded that way: {error}") from None
    if checkpoint_refusal(config.parts):
        raise LabConfigError(f"cannot load into {config.strategy}: {checkpoint_refusal(config.parts)}")
    session.ready()
    session.execute(session.targets(None), entry.load_checkpoint,
                    (config, directory, meta["step"], same_world), timeout)
    session.remember_training(config, meta["step"])
    return config
