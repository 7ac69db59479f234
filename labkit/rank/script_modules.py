"""The modules a script imports from its own folders live as long as its run, as in a fresh process.

A rank runs many scripts in one process, and ``sys.modules`` would keep what the
first one imported: ``b/main.py``'s ``import helper`` would get ``a/helper.py``, and
an edited helper would stay at its old version until the lab restarts. So, while
a script runs:

- ``sys.path`` starts with the script's folder and has no ``''`` (the current
  folder), as ``python script.py`` has it;
- a module the user imported earlier (in a cell, say) under a name the script's
  folder provides is set aside, so the script imports its own; it is put back after;
- when the run ends, the modules it imported from its folder, or from folders it
  added to ``sys.path``, are forgotten, and ``sys.path`` is as before.

Modules found in the folders that were on ``sys.path`` before (site-packages, the
standard library) stay loaded: they are not the script's, and extension modules
cannot be loaded twice in one process.

Runs in the engines.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys


@contextlib.contextmanager
def modules_of_the_run(folder: str, lasting: frozenset[str]):
    """While a script in ``folder`` runs; ``lasting``: top-level modules never set aside (the lab's)."""
    search_path = list(sys.path)
    loaded = set(sys.modules)
    sys.path[:] = [folder, *(entry for entry in search_path if entry != "")]
    importlib.invalidate_caches()  # files written since the last run must be found, as a fresh process would
    set_aside = _set_aside(_provided_by(folder) - lasting)
    try:
        yield
    finally:
        own = _absolute(folder)
        before = {_absolute(entry) for entry in search_path}
        added = {_absolute(entry) for entry in sys.path} - before - {""}
        roots = before | added | {own}
        for name in set(sys.modules) - loaded:
            root = _root(_origin(sys.modules[name]), roots)
            if root is not None and (root == own or root in added):
                del sys.modules[name]
        sys.modules.update(set_aside)
        sys.path[:] = search_path


def _provided_by(folder: str) -> set[str]:
    """Top-level module names a script in ``folder`` would import from it."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    provided = set()
    for name in names:
        if name.endswith(".py"):
            provided.add(name[:-3])
        elif os.path.isfile(os.path.join(folder, name, "__init__.py")):
            provided.add(name)
    return provided


def _set_aside(names: set[str]) -> dict:
    """Take the loaded modules ``names`` (and their submodules) out of ``sys.modules``; what was taken."""
    taken = {}
    for name in list(sys.modules):
        if name.partition(".")[0] in names:
            taken[name] = sys.modules.pop(name)
    return taken


def _origin(module) -> str | None:
    """The Python source a module was loaded from; None for built-in, extension or namespace modules."""
    path = getattr(module, "__file__", None)
    return _absolute(path) if isinstance(path, str) and path.endswith(".py") else None


def _root(path: str | None, roots: set[str]) -> str | None:
    """The search-path entry ``path`` was found under: the longest that holds it."""
    if path is None:
        return None
    holding = [root for root in roots if root and path.startswith(root.rstrip(os.sep) + os.sep)]
    return max(holding, key=len, default=None)


def _absolute(path: str) -> str:
    return os.path.realpath(path) if path else ""
