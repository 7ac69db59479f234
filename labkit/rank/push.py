"""Inside a rank: take in what the notebook pushed (``lab.push``, packed by ``labkit.runs.push``).

This module runs in the engines. The items come in the order the notebook packed them
(modules; values and functions; classes, a base before the classes made from it; values that
hold instances of the notebook's classes). Each is built into a staging dict, and the rank's
namespace changes only once every one is built: a push that fails here (a module this rank
cannot import, a class statement that raises) leaves the namespace as it was.

- a module is imported by name;
- a class statement is run with the namespace as its globals (its methods see the rank's
  names when they run) and what this push built before it in reach (its bases, decorators);
- a value is unpickled; inside it, the notebook's functions are rebuilt with the namespace as
  their globals (as ipyparallel rebuilds ``lab.run``'s), its classes found by name in this
  push or the namespace, modules imported.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections import ChainMap

_MISSING = object()


def receive(items: list[dict], namespace: dict) -> list[str]:
    """Build every item, then put them all into ``namespace`` at once; the names put there."""
    staged = build_all(items, namespace)
    namespace.update(staged)
    return list(staged)


def build_all(items: list[dict] | tuple[dict, ...], namespace: dict) -> dict:
    """Every item built, in the order packed, by name; ``namespace`` left as it was."""
    staged: dict = {}
    for item in items:
        staged[item["name"]] = build(item, namespace, staged)
    return staged


def build(item: dict, namespace: dict, staged: dict):
    how = item["how"]
    if how == "module":
        return _imported(item["module"], item["name"])
    if how == "class":
        made: dict = {}
        try:  # the names the statement reads (bases, decorators) come from this push first, then the namespace
            exec(compile(item["source"], item["cell"], "exec"), namespace, ChainMap(made, staged))
        except NameError as error:
            missing = error.name or "a name"
            raise NameError(f"the class statement of {item['name']} needs {missing}, which this rank does not "
                            f"have: push it too (lab.push({missing}={missing}, {item['name']}={item['name']})), "
                            "or import it in a %%lab cell first", name=error.name) from error
        return made[item["class_name"]]
    return PushedUnpickler(item, namespace, staged).load()


def _imported(module: str, needed_by: str):
    """``module`` imported, or an error that says the notebook has it and this rank does not, and what to do."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise type(error)(
            f"{needed_by} needs the module {module!r}, which the notebook imported and this rank cannot ({error}): "
            "install it where the ranks run, put its folder on their path (a %%lab cell: import sys; "
            "sys.path.insert(0, FOLDER)), or define what it holds in a notebook cell", name=error.name) from error


class PushedUnpickler(pickle.Unpickler):
    """Reads a pushed value; resolves what ``runs.push.NotebookPickler`` left out of the pickle."""

    def __init__(self, item: dict, namespace: dict, staged: dict) -> None:
        super().__init__(io.BytesIO(item["data"]))
        self.name = item["name"]
        self.namespace = namespace
        self.staged = staged

    def find_class(self, module, name):
        """A class or function of an importable module, by name, as pickle finds it; a module the rank
        cannot import is said to be the notebook's."""
        _imported(module, self.name)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        kind, what = pid
        if kind == "module":
            return _imported(what, self.name)
        if kind == "function":  # a CannedFunction: its globals become the namespace, as in lab.run
            return what.get_object(self.namespace)
        head, _, rest = what.partition(".")
        found = self.staged.get(head, self.namespace.get(head, _MISSING))
        if found is _MISSING:
            raise NameError(f"{self.name} holds an instance of {what}, a class the notebook defined, and this rank "
                            f"has no {head}: push it too, e.g. lab.push({head}={head}, {self.name}={self.name})")
        for part in rest.split(".") if rest else ():
            found = getattr(found, part)
        return found
