"""The functions the notebook sends to the ranks, importable without torch.

ipyparallel pickles a function by reference (module and name), so the notebook
side only needs to import this module, never the rank's own code. Each function
runs inside a rank and reaches that rank's runtime (``this_rank()``), which
imports the heavy modules there, where torch is already loaded. This package
imports nothing of the rank's code: an engine loads it by name
(``RANK_RUNTIME_MODULE``) when it starts, as a plugin is loaded.
"""

from __future__ import annotations

from labkit.wire.current import RUNTIME_NAME, this_rank  # noqa: F401 - both sides reach them here too
from labkit.wire.rank_settings import RankSettings


RANK_RUNTIME_MODULE = "labkit.rank.runtime"  # the rank's code: torch and every module a rank runs
# What an engine started by another launcher (MPI, SSH, Slurm) or joined from elsewhere runs first.
STARTUP_COMMAND = "__import__('labkit.wire.entry').wire.entry.install()"
SLOT_VARIABLE = "LABKIT_SLOT"  # how an engine came: "rank3" (the lab's own launcher), "set:ranks2", "joined"
LAUNCHED_ON_VARIABLE = "LABKIT_LAUNCHED_ON"  # the host entry of a launcher that names hosts (ssh's ``engines``)


def install() -> None:
    """Engine startup command: load the rank's code; the notebook makes the engine a rank (``become_rank``).

    An engine does not know its rank when it starts: ranks are given out as
    engines register, whichever launcher started them or wherever they joined from."""
    import gc
    import importlib
    import traceback

    from IPython import get_ipython

    namespace = get_ipython().user_ns
    try:
        importlib.import_module(RANK_RUNTIME_MODULE)  # torch and the rank's code, while the engine starts
    except Exception:
        namespace["__labkit_install_error__"] = traceback.format_exc()
    # Everything alive now (torch, IPython, ipyparallel) lives as long as the
    # engine: keep it out of the garbage collector's full passes, which a
    # training loop triggers often and which would otherwise walk it each time.
    gc.freeze()


def describe_engine() -> dict:
    """What the notebook needs to place an engine that has not become a rank yet."""
    import os
    import socket

    from IPython import get_ipython

    from labkit.wire.gpus import visible_gpus

    namespace = get_ipython().user_ns
    runtime = namespace.get(RUNTIME_NAME)
    # CUDA_VISIBLE_DEVICES's entries as given (indexes or UUIDs), else "0".."n-1": read from the
    # environment and the driver's files, never from CUDA, so describing an engine makes no CUDA context.
    gpus = visible_gpus()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slot": os.environ.get(SLOT_VARIABLE, "launched"),
        "launched_on": os.environ.get(LAUNCHED_ON_VARIABLE),
        "gpus": len(gpus),  # a notebook of an older labkit reads only the count
        "gpu_ids": list(gpus),  # the placement check finds the GPU each rank will use among them
        "rank": None if runtime is None else runtime.rank,
        "install_error": namespace.get("__labkit_install_error__"),
    }


def become_rank(settings: RankSettings) -> dict:
    """Make this engine a rank with the notebook's ``settings``; its identity."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    if "__labkit_install_error__" in namespace:
        raise RuntimeError(f"this engine could not load labkit's rank code:\n{namespace['__labkit_install_error__']}")
    import importlib

    return importlib.import_module(RANK_RUNTIME_MODULE).RankRuntime(namespace, settings).identity()


def identity() -> dict:
    return this_rank().identity()


def open_store(timeout_seconds: float) -> tuple[str, int]:
    return this_rank().open_store(timeout_seconds)


def join_group(places: dict, generation: int, timeout_seconds: float, reason: str = "") -> int:
    """``places``: engine id -> this rank's place (rank, world size, store address); ``reason``: what
    the groups of before are told when used again."""
    from IPython import get_ipython

    return this_rank().join_group(places[get_ipython().kernel.engine_id], generation, timeout_seconds, reason)


def leave_groups(reason: str) -> list[str]:
    """Retire every process group of this rank: what was built on them fails with ``reason`` from now on.
    Returns the rank's variables that hold such objects (``name (what it is)``)."""
    return this_rank().requests.leave_groups(reason)


def rebuild_groups(generation: int, timeout_seconds: float) -> int:
    """Every process group of this rank, rebuilt in place for generation ``generation``."""
    return this_rank().rebuild_groups(generation, timeout_seconds)


def put_models_in_step(failed_here: bool) -> list[str]:
    """After work that failed on some rank: this rank's DDP and FSDP2 models put as every rank puts its own."""
    return this_rank().put_models_in_step(failed_here)


def release_collectives() -> int:
    """Close this rank's group connections, so peers waiting for it in a collective fail now."""
    return this_rank().release_collectives()


def build_mesh(shape: list[int], names: list[str]):
    return this_rank().build_mesh(shape, names)


def all_reduce_check() -> float:
    return this_rank().requests.all_reduce_check()


def in_notebook_state(state: dict, work, *args):
    """``work(*args)`` after this rank took on the notebook's folder, umask and environment (``state``)."""
    runtime = this_rank()
    runtime.user_process.take_on(state, runtime.rank)
    return work(*args)


def run_cell(code: str, cell: int | None, watch: dict | None, timeout_seconds: float) -> dict:
    """``cell``: the notebook's execution count of the ``%%lab`` cell ``code`` is the body of, or None;
    ``watch``: instruments on the loop it runs (None: none)."""
    return this_rank().run_cell(code, cell, timeout_seconds, watch)


def call(fn, args, kwargs, sources: dict | None, timeout_seconds: float) -> dict:
    return this_rank().call(fn, args, kwargs, sources, timeout_seconds)


def run_task(fn, item, sources: dict | None, timeout_seconds: float) -> dict:
    """One task of a work-stealing queue (``lab.tasks``): ``fn(item)``, guarded like any call.

    Sent through ipyparallel's load-balanced view, so whichever rank is idle runs it."""
    return this_rank().call(fn, (item,), {}, sources, timeout_seconds)


def train_member(spec: dict) -> dict:
    """One ensemble member, trained alone on this rank (a task of ``lab.ensemble``)."""
    return this_rank().requests.train_member(spec)


def diloco_reference(config) -> tuple[bytes, bytes]:
    """DiLoCo of ``config`` simulated in one process on this rank: the final global weights, float32 bytes in
    parameter order (the proof of a run across sites), and the same simulated with its sums in other orders
    (the run's rounding noise)."""
    return this_rank().requests.diloco_reference(config)


def run_script(source: str, path: str, argv: list[str], watch: dict | None, timeout_seconds: float) -> dict:
    """``argv``: the script's ``sys.argv``, its path as typed first; ``watch``: instruments on its loop (None:
    none)."""
    return this_rank().run_script(source, path, argv, timeout_seconds, watch)


def seed(value: int, same: bool) -> int:
    """Seed this rank's generators: ``value`` on every rank, or ``value + rank``; return what was used.

    Remembered: every script starts seeded so again, as each would in a fresh process."""
    return this_rank().requests.seed(value, same)


def set_link(spec) -> str:
    """Give this rank's collectives the simulated link ``spec`` (a ``spec.link.LinkSpec``; None: off)."""
    return this_rank().requests.set_link(spec)


def train(config, timeout_seconds: float) -> dict:
    """One training run (or its continuation) as user work: guarded, bounded, reported."""
    return this_rank().requests.train(config, timeout_seconds)


def model_state(timeout_seconds: float) -> dict:
    """This rank's share of the trained model, whole (``lab.model_state``): every rank takes part."""
    return this_rank().requests.model_state(timeout_seconds)


def training_position() -> dict | None:
    """Where this rank's training state stands (None: it has none): step, whether an optimizer step was cut."""
    return this_rank().requests.training_position()


def save_checkpoint(target: str, partial: str, meta: dict, timeout_seconds: float) -> dict:
    """Save this rank's training state into the checkpoint ``target`` (every rank at once)."""
    return this_rank().requests.save_checkpoint(target, partial, meta, timeout_seconds)


def checkpoint_mismatches(directory: str, shares: dict) -> list:
    """Hash this rank's share of the checkpoint's files (``shares``: by rank); those whose bytes changed."""
    return this_rank().requests.checkpoint_mismatches(directory, shares)


def load_checkpoint(config, directory: str, step: int, same_world: bool, timeout_seconds: float) -> dict:
    """Build the training state for ``config`` and fill it from the checkpoint in ``directory``."""
    return this_rank().requests.load_checkpoint(config, directory, step, same_world, timeout_seconds)


def estimate_memory(config) -> dict:
    """This rank's parameter, gradient and optimizer bytes under ``config`` (a meta-device model)."""
    return this_rank().requests.estimate_memory(config)


def push(items: list, sources: dict, timeout_seconds: float) -> dict:
    """Put what the notebook pushed (``lab.push``) into this rank's namespace: all of it, or none of it.

    ``sources`` (cell name -> lines) let tracebacks show the lines of pushed notebook code."""
    return this_rank().requests.push(items, sources, timeout_seconds)

def complete_names(code: str, offset: int) -> list:
    """IPython's completions of ``code`` at ``offset`` in this rank's namespace: (start, end, text, type) each."""
    return this_rank().requests.complete_names(code, offset)


def describe_names() -> dict:
    """This rank's user variables, each described (``wire.schema.VariableInfo``): ``lab.who``."""
    return this_rank().requests.describe_names()


def debug_open() -> dict | None:
    """Open a post-mortem debugger on this rank's last failure (``%lab debug``): the exception and where it
    stopped, or None when the rank has nothing to debug."""
    return this_rank().debugging.open_post_mortem()


def debug_command(line: str) -> dict:
    """One pdb command in this rank's post-mortem session: what it printed, and whether the session ended."""
    return this_rank().debugging.post_mortem_command(line)


def debug_close() -> None:
    """End this rank's post-mortem session (its last failure is kept)."""
    this_rank().debugging.close_post_mortem()
