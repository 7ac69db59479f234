"""Save and load the ranks' training state (``lab.save(path)``, ``lab.load(path)``, ``%lab checkpoint``), and
gather the trained model whole into the notebook (``lab.model_state()``).

A checkpoint is a directory written by ``labkit.rank.checkpoint`` (torch.distributed.
checkpoint shards, every rank's random state, and ``labkit.json`` with the run's
settings, written last). A directory of checkpoints (``checkpoint_dir``, one
``step-NNNNNNNN`` each) loads its newest complete one; partial ones are ignored.

A save writes only where nothing of the user's is lost: a new path, an empty folder,
or a checkpoint labkit wrote, which it replaces (``spec.checkpoint_files`` says
which paths, and why others are refused). A save that does not complete (Ctrl-C, a
rank lost, the limit) says first what the path holds now (``save_outcome``). A load
first checks that the checkpoint's files are whole (``checkpoint_check``:
labkit.json's fields, every file's size, and every file's checksum, hashed by the
ranks at once), so a damaged one is refused by name before the ranks drop what
they hold.

Loading builds the model the checkpoint holds, under the lab's ranks and the
strategy asked for (by default the saved one), and DCP reshards it: saved on 4
ranks, loaded on 2. A checkpoint of another model than the one asked for is
refused, saying what differs. After a load, ``lab.train(steps=..., resume=True)``
continues from the checkpoint's step.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from labkit.runs.checkpoint_check import check_files, check_sums, read_meta
from labkit.runs.own_model import split_settings
from labkit.runs.own_run_checks import check_run, say_once
from labkit.spec.checkpoint_files import META_FILE, is_checkpoint_file, is_complete, partial_directory, recoverable, \
    save_refusal
from labkit.runs.save_outcome import record_at, save_failure
from labkit.spec.errors import LabBusy, LabConfigError, RankFailure
from labkit.spec.own_model import OwnModel
from labkit.spec.train_config import TrainConfig, checkpoint_settings, identity_differences, resolve
from labkit.strategies.catalog import checkpoint_refusal
from labkit.wire import entry

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

__all__ = ["META_FILE", "find_checkpoint", "is_complete", "load", "model_state", "read_meta", "save"]
STEP_PATTERN = "step-*"


def find_checkpoint(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete checkpoint inside it, else the
    whole one a save to ``path`` cut short while replacing it left beside it."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        folder = os.path.dirname(path)
        hint = (f"give its folder, {folder}" if is_checkpoint_file(os.path.basename(path))
                else "give the folder lab.save wrote (it holds labkit.json)")
        raise LabConfigError(f"{path} is a file, not a checkpoint: a checkpoint is a folder; {hint}")
    if is_complete(path):
        return path
    found = sorted(candidate for candidate in glob.glob(os.path.join(path, STEP_PATTERN)) if is_complete(candidate))
    if found:
        return found[-1]
    if not os.path.isdir(path):
        left = recoverable(path)
        if left is not None:
            return left
        raise LabConfigError(f"no checkpoint at {path}: the path does not exist")
    raise LabConfigError(f"no complete checkpoint in {path} (partial saves, if any, are ignored): "
                         "save one with lab.save(path), or train with checkpoint_every and checkpoint_dir")


def save(session: Session, path: str, timeout: float) -> str:
    """Save the training state the ranks hold into the directory ``path``; return its full path.

    ``path`` may be new, an empty folder, or a checkpoint labkit wrote (replaced); anything else is refused."""
    try:
        session.require_idle()
    except LabBusy as busy:  # the run owns the training state: saving now would race its steps
        raise LabBusy(f"cannot save now: {busy}; then save (what the ranks hold when it ends)") from None
    record = session.last_training
    if record is None:
        raise LabConfigError("there is no training state to save: train first (lab.train), or load a checkpoint; "
                             "a failure or restart since the last run drops the ranks' state")
    if checkpoint_refusal(record.config.parts):
        raise LabConfigError(f"cannot save the last run: {checkpoint_refusal(record.config.parts)}")
    target = os.path.abspath(os.path.expanduser(path))
    refusal = save_refusal(target)
    if refusal:
        raise LabConfigError(refusal)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    except OSError as error:
        raise LabConfigError(f"cannot make the folder {os.path.dirname(target)} ({error.strerror}): "
                             "give another path") from None
    meta = checkpoint_settings(record.config)
    before = record_at(target)
    try:
        session.execute(None, entry.save_checkpoint, (target, partial_directory(target), meta), timeout)
    except RankFailure as failure:  # Ctrl-C, a rank lost, the limit: say first what the path holds now
        raise save_failure(failure, target, before) from None
    return target


def model_state(session: Session, timeout: float) -> dict:
    """The last run's model, whole, merged from the ranks that send it (``rank.whole_model``)."""
    try:
        session.require_idle()
    except LabBusy as busy:
        raise LabBusy(f"cannot gather the model now: {busy}; then gather it") from None
    if session.last_training is None:
        raise LabConfigError("there is no trained model to gather: train first (lab.train), or load a checkpoint; "
                             "a failure or restart since the last run drops the ranks' state")
    reports = session.execute(None, entry.model_state, (), timeout)
    whole: dict = {}
    for rank in sorted(reports):
        held = reports[rank]["value"]
        assert isinstance(held, dict)  # rank.whole_model's
        for name, value in held.items():
            whole.setdefault(name, value)
    return whole


def _normalised(settings: dict) -> dict:
    model_settings = settings.get("model_settings") or {}
    return {**settings, "model_settings": {key: tuple(value) if isinstance(value, list) else value
                                           for key, value in model_settings.items()}}


def carried_settings(saved: dict, overrides: dict) -> dict:
    """The saved settings a load resolves with ``overrides``: all of them under the saved strategy; under
    another, only the general ones (the old strategy's own are not the new one's), and not micro_batches:
    as saved it is the old strategy's (its default, when not given), so it defaults as ``lab.train``
    defaults it (pp: one per stage) unless given again."""
    if overrides.get("strategy", saved["strategy"]) == saved["strategy"]:
        return saved
    return {key: value for key, value in saved.items()
            if key in TrainConfig.__dataclass_fields__ and key != "micro_batches"}


def load(session: Session, path: str, timeout: float, mesh: dict | None = None, say: bool = True,
         **overrides) -> TrainConfig:
    """Load the checkpoint at ``path`` into the ranks (resharded to them); return the run's config.

    ``say``: print which step was loaded (a heal says it in its own words)."""
    directory = find_checkpoint(path)
    meta = read_meta(directory)
    check_files(directory, meta)
    if os.path.basename(directory).startswith("."):
        print(f"labkit: a save to {os.path.abspath(os.path.expanduser(path))} was cut short while it replaced the "
              f"checkpoint there; loading the whole one it left beside it, {directory} (the next save to that "
              "path puts it in place)")
    saved = _normalised(meta["settings"])
    overrides, inspection = split_settings(dict(overrides))  # the user's own model, given again, packed
    if saved.get("own") and not isinstance(overrides.get("own"), OwnModel):
        raise LabConfigError(f"the checkpoint {directory} holds your own model {saved['own']['name']}: give it again, "
                             f"with its data and loss: lab.load(path, model={saved['own']['name']}, data=..., "
                             "loss=...)")
    differences = identity_differences(saved, overrides)
    if differences:
        raise LabConfigError(f"the checkpoint {directory} holds another model: {'; '.join(differences)}. "
                             "Load it as it was saved, or train the other model afresh")
    same_world = meta["world_size"] == session.world_size
    saved = carried_settings(saved, overrides)
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
    if inspection is not None:
        say_once(session.said, check_run(inspection, config))
    cluster = session.ready()
    ranks = range(session.world_size)
    check_sums(directory, meta, session.world_size,
               lambda shares: cluster.call(ranks, entry.checkpoint_mismatches, (directory, shares), timeout))
    session.execute(None, entry.load_checkpoint,
                    (config, directory, meta["step"], same_world), timeout)
    session.remember_training(config, meta["step"])
    if say:
        print(f"loaded step {meta['step']}: {config.describe()}")
    return config
