"""A run's own checkpoints (``checkpoint_every``) and how many of them it keeps (``keep_checkpoints``).

Every ``checkpoint_every`` steps the ranks save ``checkpoint_dir/step-NNNNNNNN``.
So that a long run does not fill the disk, only the newest ``keep_checkpoints``
(3 unless asked; None keeps all) stay: a heal needs only the newest. The run says
so once, the first time it removes one. It removes only what this logic wrote for
the same model: a ``step-NNNNNNNN`` folder holding nothing but a checkpoint's files,
whose ``labkit.json`` says it was written by ``checkpoint_every``, at or before the
step just saved. A checkpoint saved by hand, another model's, or anything else in
the folder stays as it is.
"""

from __future__ import annotations

import json
import os
import re

import torch.distributed as dist

from labkit.spec.checkpoint_files import is_checkpoint, partial_directory, read_json, remove_checkpoint

WRITER = "checkpoint_every"  # what labkit.json says wrote a periodic checkpoint
_STEP_NAME = re.compile(r"step-(\d{8})")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _plain(value):
    """A value as labkit.json gives it back (tuples are lists), so that saved and current compare."""
    return json.loads(json.dumps(value))


def model_identity(settings: dict) -> dict:
    from labkit.spec.train_config import MODEL_IDENTITY

    return _plain({name: settings.get(name) for name in MODEL_IDENTITY})


def prunable(directory: str, step: int, identity: dict, keep: int) -> list[str]:
    """What in ``directory`` goes so that the newest ``keep`` of this logic's checkpoints of the model
    ``identity`` at or before ``step`` stay: their names, oldest first."""
    ours = []
    for name in os.listdir(directory):
        match = _STEP_NAME.fullmatch(name)
        path = os.path.join(directory, name)
        if not match or int(match[1]) > step or not is_checkpoint(path):
            continue
        meta = read_json(path) or {}
        settings = meta.get("settings")
        if meta.get("written_by") == WRITER and isinstance(settings, dict) and model_identity(settings) == identity:
            ours.append(name)
    ours.sort()
    return ours[:-keep] if len(ours) > keep else []


class PeriodicCheckpoints:
    """One run's checkpoints: each saved, the oldest beyond ``keep_checkpoints`` removed."""

    def __init__(self, config) -> None:
        from labkit.spec.train_config import checkpoint_settings

        self.config = config
        self.meta = {**checkpoint_settings(config), "written_by": WRITER}
        self.identity = model_identity(self.meta["settings"])
        self.said = False  # whether this run has told that it removes old ones

    def save(self, state) -> str:
        from labkit.rank.checkpoint import save

        config = self.config
        os.makedirs(config.checkpoint_dir, exist_ok=True)
        target = os.path.join(os.path.abspath(config.checkpoint_dir), step_name(state.step))
        # Every rank names the work folder alike without a word: the step is the same on all.
        save(state, target, partial_directory(target, f"{state.step % 16**8:08x}"), self.meta)
        if config.keep_checkpoints and dist.get_rank() == 0:
            self._prune(state.step)
        return target

    def _prune(self, step: int) -> None:
        config = self.config
        removed = prunable(config.checkpoint_dir, step, self.identity, config.keep_checkpoints)
        for name in removed:
            remove_checkpoint(os.path.join(config.checkpoint_dir, name))
        if removed and not self.said:
            self.said = True
            print(f"labkit: keeping the newest {config.keep_checkpoints} checkpoints in {config.checkpoint_dir} "
                  f"(keep_checkpoints={config.keep_checkpoints}; None keeps all): removed {', '.join(removed)}",
                  flush=True)
