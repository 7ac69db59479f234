"""Checkpoints of the ranks' ``TrainState`` on torch.distributed.checkpoint (DCP).

What is saved: the model and optimizer state as each rank holds them (sharded
DTensors under FSDP and TP, a stage's layers under PP, one copy under DDP), by
their unwrapped parameter names (``get_state_dict``), so a checkpoint loads into
another number of ranks or another sharding and DCP reshards it; the step (which
is also the data position); every rank's random state; what a strategy keeps of
its own (``ParallelModel.extra_state``: DiLoCo's global copy, outer momentum and
each replica's place in its round); and, from rank 0, a ``labkit.json`` with the
run's settings, written last.

Atomic: every rank writes into a ``.partial-*`` directory beside the target; once
all have written, rank 0 writes ``labkit.json`` and renames the directory into
place (an older checkpoint of the same name is moved aside first and removed
after). A save cut short leaves only a partial directory, which loading ignores,
and the previous checkpoint stays as it was.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from labkit.rank.state import TrainState, restore_random_state

META_FILE = "labkit.json"  # present only in a complete checkpoint


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"random-state-rank{rank}.pt")


def _app_state(state: TrainState, loading: bool = False) -> dict:
    model, optimizer = get_state_dict(state.model, state.optimizer)
    app = {"model": model, "optimizer": optimizer}
    for name, extra in state.parallel.extra_state.items():
        # A part's own state (DiLoCo's outer step). Saving, it may change what the model and optimizer
        # entries hold; loading, it builds its entry on a copy, so the template loads what was saved.
        app[name] = extra.state_dict(dict(app) if loading else app)
    return app


def _found_only(directory: str, app: dict, extras) -> dict:
    """``app`` without the parts of each extra entry the checkpoint lacks (saved under another strategy
    or replica count): DCP refuses to load a key it does not find."""
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    found = {".".join(key.split(".")[:2]) for key in saved}  # entry.part: "diloco.momentum"
    for name in extras:
        kept = {key: value for key, value in app.pop(name).items() if f"{name}.{key}" in found}
        if kept:
            app[name] = kept
    return app


def save(state: TrainState, target: str, partial: str, meta: dict) -> str:
    """Save ``state`` to ``target`` (a directory) on every rank at once; return ``target``."""
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(partial):
        shutil.rmtree(partial)  # what an interrupted save of the same name left
    dist.barrier()
    state.pause()  # the random state as of now, saved below
    dcp.save(_app_state(state), checkpoint_id=partial)
    torch.save(state.rng, _rng_file(partial, rank))
    dist.barrier()  # everyone has written
    if rank == 0:
        with open(os.path.join(partial, META_FILE), "w") as handle:
            json.dump({**meta, "step": state.step, "world_size": dist.get_world_size()}, handle, indent=1)
        aside = f"{partial}.replaced"
        if os.path.exists(target):
            os.rename(target, aside)
        os.rename(partial, target)
        shutil.rmtree(aside, ignore_errors=True)
    dist.barrier()  # nobody returns before the checkpoint is in place
    return target


def load(state: TrainState, directory: str, step: int, same_world: bool) -> int:
    """Load a checkpoint into ``state`` (built for the checkpoint's settings); return its step."""
    extras = state.parallel.extra_state
    app = _found_only(directory, _app_state(state, loading=True), extras)
    dcp.load(app, checkpoint_id=directory)
    set_state_dict(state.model, state.optimizer, model_state_dict=app["model"], optim_state_dict=app["optimizer"])
    for name, extra in extras.items():  # after the model: an extra entry may build on the loaded parameters
        extra.load_state_dict(app.get(name), state.optimizer)
    state.step = step
    rng = _rng_file(directory, dist.get_rank())
    if same_world and os.path.exists(rng):  # on other ranks there is no one state to continue
        state.rng = torch.load(rng, weights_only=False)
        restore_random_state(state.rng)
    return step


def save_during_run(state: TrainState, config) -> str:
    """The loop's periodic checkpoint: ``checkpoint_dir/step-NNNNNNNN`` after every ``checkpoint_every`` steps."""
    from labkit.spec.train_config import checkpoint_settings

    name = f"step-{state.step:08d}"
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    target = save(state, os.path.join(config.checkpoint_dir, name),
                  os.path.join(config.checkpoint_dir, f".partial-{name}"), checkpoint_settings(config))
    if config.keep_checkpoints and dist.get_rank() == 0:
        complete = sorted(entry for entry in os.listdir(config.checkpoint_dir)
                          if entry.startswith("step-") and os.path.isfile(os.path.join(config.checkpoint_dir, entry,
                                                                                       META_FILE)))
        for old in complete[:-config.keep_checkpoints]:  # the newest stay; a heal needs only the last
            shutil.rmtree(os.path.join(config.checkpoint_dir, old), ignore_errors=True)
    return target
