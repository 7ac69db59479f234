"""Run a script written for torchrun, unmodified, as ``__main__`` on a rank.

``Lab.run_script`` sends the script's source to every rank; each rank runs it
as torchrun's process would: as ``__main__``, with ``sys.argv`` set and the
script's folder first on ``sys.path``, in a namespace of its own (the rank's
cell variables are not in its way). What differs, and how it is bridged:

- The process group already exists. The script's own ``init_process_group``
  returns at once when its settings fit the lab's group (and rank 0 says so);
  one that asks for another backend, world size or rank is refused with the
  reason. ``destroy_process_group()`` of the default group leaves the lab's
  group in place for the next cell (and says so); other groups are destroyed.
- ``exit()`` and ``sys.exit()`` end the script. An exit with code 0 (or no
  code) has succeeded on that rank; any other code fails it with the code.
  (In an engine the builtin ``exit`` is IPython's, which returns and lets the
  lines after it run; the script gets the plain one.)
- Tracebacks show the script's lines: its source is registered under its path.

Runs in the engines.
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import os
import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


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
def lab_process_group(rank: int, world_size: int, backend: str):
    """While a script runs: its init/destroy of the default group meet the lab's group."""
    original_init, original_destroy = c10d.init_process_group, c10d.destroy_process_group
    said = set()

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
            return None
        return original_destroy(group)

    for module in (dist, c10d):
        module.init_process_group, module.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        for module in (dist, c10d):
            module.init_process_group, module.destroy_process_group = original_init, original_destroy


@contextlib.contextmanager
def script_process(path: str, args: list[str]):
    """``sys.argv`` and ``sys.path`` as the script's own process would have them."""
    argv, search_path = list(sys.argv), list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = argv, search_path


def run_script(source: str, path: str, args: list[str]) -> int:
    """Run ``source`` (the file at ``path``) as ``__main__``; return its exit status (0), or raise."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins,
                 "exit": sys.exit, "quit": sys.exit}
    code = compile(source, path, "exec")
    # The lab's group stands in for the script's init/destroy: the runtime runs all
    # user work inside ``lab_process_group`` already.
    with script_process(path, args):
        try:
            exec(code, namespace)
        except SystemExit as exited:
            status = exit_code(exited.code)
            if status:
                message = f": {exited.code}" if not isinstance(exited.code, int) else ""
                raise ScriptExit(f"the script exited with code {status}{message}") from None
    return 0
