"""Run a script written for torchrun, unmodified, as ``__main__`` on a rank.

``Lab.run_script`` sends the script's source to every rank; each rank runs it
as torchrun's process would: as the module ``__main__`` (``sys.modules['__main__']``
is the script's while it runs, so its classes pickle and ``torch.save`` them),
with ``sys.argv`` as typed and the script's folder first on ``sys.path``. What
differs from a fresh process, and how it is bridged:

- The process group already exists. The script's own ``init_process_group``
  returns at once when its settings fit the lab's group (and rank 0 says so);
  one that asks for another backend, world size or rank is refused with the
  reason. ``destroy_process_group()`` of the default group leaves the lab's
  group in place for the next cell (and says so), and destroys the groups the
  script (or cell) made; a script's groups are destroyed when it ends in any case.
- ``exit()`` and ``sys.exit()`` end the script. An exit with code 0 (or no
  code) has succeeded on that rank; any other code fails it with the code.
  (In an engine the builtin ``exit`` is IPython's, which returns and lets the
  lines after it run; the script gets the plain one.)
- The modules it imports from its folder are forgotten when it ends
  (``labkit.rank.script_modules``); its random state is fresh (``RankRuntime.run_script``);
  it starts with logging unconfigured, and what it configured goes when it ends
  (``labkit.rank.script_logging``).
- Tracebacks show the script's lines: its source is registered under its path.

Runs in the engines.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import types

import torch.distributed as dist

from labkit.rank.environment import script_environment
from labkit.rank.group_memory import forget_old_groups
from labkit.rank.script_logging import logging_of_the_run
from labkit.rank.script_modules import modules_of_the_run
from labkit.torch_support.torch_internals import all_process_groups, group_lifecycle, group_lifecycle_replaced


class ScriptExit(RuntimeError):
    """A script exited with a non-zero code on this rank."""


def exit_code(code) -> int:
    """The process exit status ``sys.exit(code)`` stands for: None is 0, a message is 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _same_backend(asked: str | None, lab_backend: str) -> bool:
    if asked is None:
        return True
    asked = str(asked).lower()
    return asked == lab_backend or (lab_backend == "nccl" and "nccl" in asked)


@contextlib.contextmanager
def lab_process_group(rank: int, world_size: int, backend: str, destroy_at_end: bool = False):
    """While user work runs: its init/destroy of the default group meet the lab's group.

    ``destroy_at_end``: the groups the work made are destroyed when it ends (a script's:
    its process would have ended)."""
    original_init, original_destroy = group_lifecycle()
    said = set()
    # Groups that existed before the work (the lab's world group and mesh, groups of earlier cells) are not its own.
    earlier = set(all_process_groups())

    def destroy_its_groups() -> None:
        made = [group for group in all_process_groups() if group not in earlier]
        for group in made:
            try:
                original_destroy(group)
            except Exception:  # noqa: BLE001 - a group a failed collective broke may complain on the way out
                pass
        if made:
            forget_old_groups()  # DTensor's plans and torch's mesh stack must not name them any more

    def say_once(message: str) -> None:
        if message not in said and rank == 0:
            print(f"[labkit] {message}", flush=True)
        said.add(message)

    def init_process_group(backend_asked=None, init_method=None, timeout=None, world_size_asked=-1,
                           rank_asked=-1, *args, **kwargs):
        backend_asked = kwargs.pop("backend", backend_asked)
        world_size_asked = kwargs.pop("world_size", world_size_asked)
        rank_asked = kwargs.pop("rank", rank_asked)
        if not dist.is_initialized():
            return original_init(backend_asked, init_method, timeout, world_size_asked, rank_asked, *args, **kwargs)
        if not _same_backend(backend_asked, backend):
            raise ValueError(f"init_process_group({backend_asked!r}): this lab's ranks run {backend}; start the lab "
                             f"with backend={backend_asked!r} to run this script, or let it use {backend}")
        if world_size_asked not in (-1, None, world_size) or rank_asked not in (-1, None, rank):
            raise ValueError(f"init_process_group(world_size={world_size_asked}, rank={rank_asked}): this lab has "
                             f"{world_size} ranks and this is rank {rank}; run the script on a lab of that size")
        say_once(f"init_process_group: the lab's process group is already in place ({backend}, "
                 f"{world_size} ranks); the script uses it")

    def destroy_process_group(group=None):
        if group is None or group is dist.group.WORLD:
            say_once("destroy_process_group(): the lab keeps its process group for the next cell")
            destroy_its_groups()
            return None
        return original_destroy(group)

    with group_lifecycle_replaced(init_process_group, destroy_process_group):
        yield
    # Reached when the work succeeded; a failed one's groups all go with the lab's rebuild.
    if destroy_at_end and dist.is_initialized():
        destroy_its_groups()


@contextlib.contextmanager
def script_process(path: str, argv: list[str], lasting_modules: frozenset[str]):
    """``sys.argv``, ``sys.path``, ``sys.modules``, logging and the environment as the script's own process would
    have them.

    Yields the module ``__main__`` to run the script in."""
    main = types.ModuleType("__main__")
    # What ``runpy.run_path`` gives a script; IPython's exit would return and let the rest run.
    main.__dict__.update({"__file__": path, "__cached__": None, "__loader__": None, "__package__": None,
                          "__spec__": None, "exit": sys.exit, "quit": sys.exit})
    saved_argv, saved_main = list(sys.argv), sys.modules.get("__main__")
    sys.argv = list(argv)
    sys.modules["__main__"] = main
    try:
        with modules_of_the_run(os.path.dirname(os.path.abspath(path)), lasting_modules), script_environment(), \
                logging_of_the_run():
            yield main
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def run_script(source: str, path: str, argv: list[str], lasting_modules: frozenset[str] = frozenset()) -> int:
    """Run ``source`` (the file at ``path``) as ``__main__`` with ``sys.argv = argv``; return its exit status
    (0), or raise. ``lasting_modules``: top-level modules the script's folder must not displace (the lab's)."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    code = compile(source, path, "exec")
    # The lab's group stands in for the script's init/destroy: the runtime runs all
    # user work inside ``lab_process_group`` already.
    with script_process(path, argv, lasting_modules) as main:
        try:
            exec(code, main.__dict__)
        except SystemExit as exited:
            status = exit_code(exited.code)
            if status:
                message = f": {exited.code}" if not isinstance(exited.code, int) else ""
                raise ScriptExit(f"the script exited with code {status}{message}") from None
    return 0
