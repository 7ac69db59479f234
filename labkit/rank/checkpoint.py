"""Checkpoints of the ranks' ``TrainState`` on torch.distributed.checkpoint (DCP).

What is saved: the model and optimizer state as each rank holds them (sharded
DTensors under FSDP and TP, a stage's layers under PP, one copy under DDP), by
their unwrapped parameter names (``get_state_dict``), so a checkpoint loads into
another number of ranks or another sharding and DCP reshards it; the step (which
is also the data position); every rank's random state; what a strategy keeps of
its own (``ParallelModel.extra_state``: DiLoCo's global copy, outer momentum and
each replica's place in its round); and, from rank 0, a ``labkit.json`` with the
run's settings and every other file's size and SHA-256 (``checkpoint_sums``: each
rank hashes what it wrote), written last.

Atomic: every rank writes into a ``.partial-*`` folder beside the target; once all
have written, rank 0 writes ``labkit.json`` and puts the folder in place
(``checkpoint_swap``: one exchange with the previous checkpoint of that name where
the system allows, so a kill at any instant leaves the old or the new one whole).
Only a previous labkit checkpoint, an empty folder or nothing may be at the target
(``checkpoint_files``); anything else is refused before a byte is written. What a
save cut short left is tidied by the next save to that path.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from labkit.spec.checkpoint_files import META_FILE, save_refusal, tidy
from labkit.spec.checkpoint_sums import own_records, unrecorded
from labkit.rank.checkpoint_swap import put_in_place
from labkit.rank.state import TrainState, restore_random_state
from labkit.spec.errors import LabConfigError


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _interrupted(error: BaseException) -> bool:
    """An interrupt, or DCP's wrapping of one (it gathers every rank's failure into a CheckpointException)."""
    if isinstance(error, KeyboardInterrupt):
        return True
    failures = getattr(error, "failures", None)
    return isinstance(failures, dict) and any(isinstance(failure[0], KeyboardInterrupt)
                                              for failure in failures.values() if isinstance(failure, tuple))


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
    # Every rank sees the same folder, so all refuse alike and none is left waiting in a barrier.
    refusal = save_refusal(target)
    if refusal:
        raise LabConfigError(refusal)
    dist.barrier()
    if rank == 0:
        tidy(target)  # what a save to this path cut short left beside it
    dist.barrier()
    state.pause()  # the random state as of now, saved below
    try:
        dcp.save(_app_state(state), checkpoint_id=partial)
        torch.save(state.rng, _rng_file(partial, rank))
        # Each rank hashes what it wrote, all at once; gathering the records is also "everyone has written".
        mine = own_records(partial, rank)
        gathered: list = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    except BaseException as error:  # DCP wraps an interrupt in CheckpointException, a BaseException
        if _interrupted(error):
            raise KeyboardInterrupt(f"the save was cut while the ranks wrote {partial}") from None
        raise
    if rank == 0:
        files = {name: record for records in gathered for name, record in records.items()}
        files.update(unrecorded(partial, files))
        written = os.path.join(partial, META_FILE + ".tmp")
        with open(written, "w") as handle:
            json.dump({**meta, "step": state.step, "world_size": dist.get_world_size(), "files": files}, handle,
                      indent=1)
        os.replace(written, os.path.join(partial, META_FILE))  # whole or absent, never cut short
        put_in_place(partial, target)
    dist.barrier()  # nobody returns before the checkpoint is in place
    return target


def load(state: TrainState, directory: str, step: int, same_world: bool) -> int:
    """Load a checkpoint into ``state`` (built for the checkpoint's settings); return its step."""
    extras = state.parallel.extra_state
    try:
        app = _found_only(directory, _app_state(state, loading=True), extras)
        dcp.load(app, checkpoint_id=directory)
    except Exception as error:  # the notebook checked the files; this is damage inside them, or a peer lost
        raise RuntimeError(f"the checkpoint {directory} could not be read: {_first_line(error)}. If a file in "
                           "it is damaged, load another checkpoint (an older one in its folder) or save anew") \
            from error
    set_state_dict(state.model, state.optimizer, model_state_dict=app["model"], optim_state_dict=app["optimizer"])
    for name, extra in extras.items():  # after the model: an extra entry may build on the loaded parameters
        extra.load_state_dict(app.get(name), state.optimizer)
    state.step = step
    rng = _rng_file(directory, dist.get_rank())
    if same_world and os.path.exists(rng):  # on other ranks there is no one state to continue
        try:
            state.rng = torch.load(rng, weights_only=False)
        except Exception as error:
            raise RuntimeError(f"{rng} could not be read ({_first_line(error)}): the checkpoint is damaged; "
                               "load another checkpoint (an older one in its folder) or save anew") from error
        restore_random_state(state.rng)
    return step
