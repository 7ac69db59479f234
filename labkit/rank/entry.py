"""The functions the notebook sends to the ranks, importable without torch.

ipyparallel pickles a function by reference (module and name), so the notebook
side only needs to import this module, never the rank's own code. Each function
runs inside a rank and reaches that rank's ``RankRuntime`` (``labkit.rank.runtime``),
importing the heavy modules there, where torch is already loaded.
"""

from __future__ import annotations

from labkit.rank.current import RUNTIME_NAME, this_rank  # noqa: F401 - both sides reach them here too


SLOT_VARIABLE = "LABKIT_SLOT"  # how an engine came: "rank3" (the lab's own launcher), "set:ranks2", "joined"


def install() -> None:
    """Engine startup command: load the rank's code; the notebook makes the engine a rank (``become_rank``).

    An engine does not know its rank when it starts: ranks are given out as
    engines register, whichever launcher started them or wherever they joined from."""
    import gc
    import traceback

    from IPython import get_ipython

    namespace = get_ipython().user_ns
    try:
        import labkit.rank.runtime  # noqa: F401 - torch and the rank's code, imported while the engine starts
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

    from labkit.cluster.placement import visible_gpus

    namespace = get_ipython().user_ns
    runtime = namespace.get(RUNTIME_NAME)
    # CUDA_VISIBLE_DEVICES's entries as given (indexes or UUIDs), else "0".."n-1": read from the
    # environment and the driver's files, never from CUDA, so describing an engine makes no CUDA context.
    gpus = visible_gpus()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slot": os.environ.get(SLOT_VARIABLE, "launched"),
        "gpus": len(gpus),  # a notebook of an older labkit reads only the count
        "gpu_ids": list(gpus),  # the placement check finds the GPU each rank will use among them
        "rank": None if runtime is None else runtime.rank,
        "install_error": namespace.get("__labkit_install_error__"),
    }


def become_rank(settings: dict) -> dict:
    """Make this engine a rank with the notebook's ``settings``; its identity."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    if "__labkit_install_error__" in namespace:
        raise RuntimeError(f"this engine could not load labkit's rank code:\n{namespace['__labkit_install_error__']}")
    from labkit.rank.runtime import RankRuntime

    return RankRuntime(namespace, settings).identity()


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
    from labkit.rank.stale_objects import distributed_variables

    runtime = this_rank()
    held = distributed_variables(runtime.namespace) if runtime.groups.handles else []
    runtime.leave_group(reason)
    return held


def rebuild_groups(generation: int, timeout_seconds: float) -> int:
    """Every process group of this rank, rebuilt in place for generation ``generation``."""
    return this_rank().rebuild_groups(generation, timeout_seconds)


def release_collectives() -> int:
    """Close this rank's group connections, so peers waiting for it in a collective fail now."""
    return this_rank().release_collectives()


def build_mesh(shape: list[int], names: list[str]):
    return this_rank().build_mesh(shape, names)


def all_reduce_check() -> float:
    return this_rank().all_reduce_check()


def in_notebook_state(state: dict, work, *args):
    """``work(*args)`` after this rank took on the notebook's folder, umask and environment (``state``)."""
    runtime = this_rank()
    runtime.user_process.take_on(state, runtime.rank)
    return work(*args)


def run_cell(code: str, cell: int | None, timeout_seconds: float) -> dict:
    """``cell``: the notebook's execution count of the ``%%lab`` cell ``code`` is the body of, or None."""
    return this_rank().run_cell(code, cell, timeout_seconds)


def call(fn, args, kwargs, sources: dict | None, timeout_seconds: float) -> dict:
    return this_rank().call(fn, args, kwargs, sources, timeout_seconds)


def run_task(fn, item, sources: dict | None, timeout_seconds: float) -> dict:
    """One task of a work-stealing queue (``lab.tasks``): ``fn(item)``, guarded like any call.

    Sent through ipyparallel's load-balanced view, so whichever rank is idle runs it."""
    return this_rank().call(fn, (item,), {}, sources, timeout_seconds)


def train_member(spec: dict) -> dict:
    """One ensemble member, trained alone on this rank (a task of ``lab.ensemble``)."""
    from labkit.rank.ensemble import train_member as train

    return train(spec)


def run_script(source: str, path: str, argv: list[str], timeout_seconds: float) -> dict:
    """``argv``: the script's ``sys.argv``, its path as typed first."""
    return this_rank().run_script(source, path, argv, timeout_seconds)


def seed(value: int, same: bool) -> int:
    """Seed this rank's generators: ``value`` on every rank, or ``value + rank``; return what was used.

    Remembered: every script starts seeded so again, as each would in a fresh process."""
    from labkit.rank.environment import seed_as_asked

    runtime = this_rank()
    runtime.seeding = (value, same)
    return seed_as_asked(runtime.seeding, runtime.rank)


def set_link(spec) -> str:
    """Give this rank's collectives the simulated link ``spec`` (a ``spec.link.LinkSpec``; None: off)."""
    from labkit.rank.instruments.slow_link import apply_link

    return apply_link(this_rank(), spec)


def train(config, timeout_seconds: float) -> dict:
    """One training run (or its continuation) as user work: guarded, bounded, reported."""
    from labkit.rank.loop import train as train_loop

    return this_rank().call(train_loop, (config,), {}, None, timeout_seconds)


def training_position() -> dict | None:
    """Where this rank's training state stands (None: it has none): step, whether an optimizer step was cut."""
    runtime = this_rank()
    state = runtime.train_state
    if state is None:
        return None
    return {"step": state.step, "updating": state.updating, "formation": state.formation,
            "current": state.formation == runtime.formation}


def save_checkpoint(target: str, partial: str, meta: dict, timeout_seconds: float) -> dict:
    """Save this rank's training state into the checkpoint ``target`` (every rank at once)."""
    runtime = this_rank()

    def save():
        from labkit.rank.checkpoint import save as save_state

        if runtime.train_state is None:
            raise RuntimeError("this rank has no training state to save (it was restarted since the run): "
                               "train again, or load a checkpoint")
        return save_state(runtime.train_state, target, partial, meta)

    return runtime.call(save, (), {}, None, timeout_seconds)


def load_checkpoint(config, directory: str, step: int, same_world: bool, timeout_seconds: float) -> dict:
    """Build the training state for ``config`` and fill it from the checkpoint in ``directory``."""
    runtime = this_rank()

    def load():
        from labkit.rank.checkpoint import load as load_state
        from labkit.rank.optimizers import make_optimizer
        from labkit.rank.state import build_state

        runtime.train_state = None  # the old model's memory goes before the new one is built
        state = build_state(config, runtime, make_optimizer)
        load_state(state, directory, step, same_world)
        runtime.train_state = state
        return state.step

    return runtime.call(load, (), {}, None, timeout_seconds)


def estimate_memory(config) -> dict:
    """This rank's parameter, gradient and optimizer bytes under ``config`` (a meta-device model)."""
    from labkit.rank.loop import estimate_memory as estimate

    return estimate(config)


def push(items: list, sources: dict, timeout_seconds: float) -> dict:
    """Put what the notebook pushed (``lab.push``) into this rank's namespace: all of it, or none of it.

    ``sources`` (cell name -> lines) let tracebacks show the lines of pushed notebook code."""
    from labkit.rank.push import receive

    runtime = this_rank()
    return runtime.call(receive, (items, runtime.namespace), {}, sources, timeout_seconds)
