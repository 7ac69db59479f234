"""``lab.push``: the notebook's functions, classes, modules and values into the ranks' namespaces.

A rank's namespace starts with the lab's names only (``rank``, ``world_size``, ``device``,
``mesh``, ``torch``, ``dist``): a helper the notebook defined, a module it imported or a
variable it set is a ``NameError`` in a ``%%lab`` cell until it is pushed. Each value travels
the way that works on a rank:

- a function defined in the notebook: by source, as ``lab.run`` sends one (its code, defaults
  and closure, and its cell's lines, so a traceback on a rank shows them); on the rank its
  globals are the rank's namespace, so it sees ``rank``, ``mesh`` and what else is there;
- a class defined in the notebook: by source, its ``class`` statement (decorators included),
  found in the cell that defined it and run again on the rank (its bases and decorators must
  be there: push or import them too);
- a module: by name, imported on each rank (``import numpy as np``, then ``lab.push(np=np)``);
- anything else: pickled. Functions and classes of importable modules go by reference, as
  pickle sends them; inside a value, the notebook's own functions go by source, its classes by
  name (push them with it, or before) and modules by name.

Everything is packed here before any rank is asked; every value that cannot travel is named
in one ``LabConfigError`` and nothing is sent. Each rank builds all it was sent before its
namespace changes (``labkit.rank.push``), so a push that fails there leaves it as it was.
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import linecache
import os
import pickle
import re
import sys
import textwrap
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING

from labkit.runs.sources import notebook_sources
from labkit.spec.errors import LabConfigError, format_ranks
from labkit.wire import entry

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

NOTEBOOK_MODULE = "__main__"  # IPython defines a cell's functions and classes in this module
# The names every rank's runtime sets: a push may not replace them (torch and dist: only by the same module).
LAB_NAMES = {"rank": None, "world_size": None, "device": None, "mesh": None, "__labkit__": None,
             "torch": "torch", "dist": "torch.distributed"}
# The order in which a rank builds what it is sent: what a class statement may need comes before it,
# values that hold instances of the notebook's classes after.
MODULE, VALUE, CLASS, NEEDS_CLASSES = range(4)


def from_notebook(value) -> bool:
    """Whether ``value`` is a function or class defined in the notebook (not importable by name)."""
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == NOTEBOOK_MODULE


def module_name(module: types.ModuleType) -> str | None:
    """The name the ranks import ``module`` by; None when it was not imported by a name."""
    name = getattr(module, "__name__", None)
    return name if name and name != NOTEBOOK_MODULE and sys.modules.get(name) is module else None


class NotebookPickler(pickle.Pickler):
    """Pickle for the ranks: the notebook's functions by source, its classes by name, modules by name."""

    def __init__(self, file, pushed_classes: dict[int, str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.pushed_classes = pushed_classes  # id(class) -> the name it is pushed under
        self.needs_classes = False

    def persistent_id(self, obj):
        if isinstance(obj, types.ModuleType):
            name = module_name(obj)
            if name is None:
                raise pickle.PicklingError(f"it holds the module {getattr(obj, '__name__', obj)!r}, which was not "
                                           "imported by a name the ranks could import")
            return ("module", name)
        if not from_notebook(obj):
            return None
        if isinstance(obj, types.FunctionType):
            from ipyparallel.serialize.canning import CannedFunction  # how lab.run sends a function

            return ("function", CannedFunction(obj))
        self.needs_classes = True
        return ("class", self.pushed_classes.get(id(obj), obj.__qualname__))


def pickled(value, pushed_classes: dict[int, str]) -> tuple[bytes, bool]:
    """(the bytes, whether a rank needs the notebook's classes to read them)."""
    buffer = io.BytesIO()
    pickler = NotebookPickler(buffer, pushed_classes)
    pickler.dump(value)
    return buffer.getvalue(), pickler.needs_classes


# -- classes by source ------------------------------------------------------------


def _cell_tree(lines: list[str]):
    """The syntax tree of a cell's lines; IPython's own syntax (``%magic``, ``!cmd``) made Python first."""
    text = "".join(lines)
    try:
        return ast.parse(text)
    except SyntaxError:
        pass
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return ast.parse(TransformerManager().transform_cell(text))
    except (ImportError, SyntaxError):
        return None


def _class_node(lines: list[str], name: str, line: int | None):
    """The ``class name`` statement in a cell: the one around ``line``, or the cell's last one at its top."""
    if not re.search(rf"\bclass\s+{re.escape(name)}\b", "".join(lines)):
        return None
    tree = _cell_tree(lines)
    if tree is None:
        return None
    nodes = ast.walk(tree) if line is not None else tree.body
    found = [node for node in nodes if isinstance(node, ast.ClassDef) and node.name == name
             and (line is None or _first_line(node) <= line <= (node.end_lineno or node.lineno))]
    return found[-1] if found else None


def _first_line(node) -> int:
    return min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])


def _method_places(cls) -> list[tuple[str, int]]:
    """(file name, first line) of the methods written in the class's body (not a decorator's wrappers),
    where their lines are known."""
    places = []
    for value in vars(cls).values():
        for part in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
            code = getattr(part, "__code__", None)
            if code is not None and code.co_qualname.startswith(f"{cls.__qualname__}.") \
                    and linecache.getlines(code.co_filename):
                places.append((code.co_filename, code.co_firstlineno))
    return places


def _cells_newest_first() -> list[str]:
    """The notebook's cells (lines kept by IPython under names that are no file), the newest first."""
    return [name for name in reversed(list(linecache.cache))
            if not os.path.exists(name) and not name.startswith("<frozen") and name != "<string>"]


def class_statement(cls) -> tuple[str, list[str], str] | None:
    """(cell name, its lines, source) of the ``class`` statement that made ``cls``; the source keeps the
    cell's line numbers. A class with methods is found by their lines; one without, in the newest cell
    that defines a class of its name."""
    places: Sequence[tuple[str, int | None]] = _method_places(cls) or [(name, None) for name in _cells_newest_first()]
    for filename, line in places:
        lines = linecache.getlines(filename)
        node = _class_node(lines, cls.__name__, line)
        if node is not None:
            first = _first_line(node)
            source = "\n" * (first - 1) + textwrap.dedent("".join(lines[first - 1:node.end_lineno]))
            try:
                compile(source, filename, "exec")
            except SyntaxError:
                continue
            return filename, lines, source
    return None


# -- packing -------------------------------------------------------------------------


def check_name(name, value, shadows_builtins: bool = False) -> str | None:
    """Why ``name`` cannot be pushed (None: it can). ``shadows_builtins``: a value may take a builtin's name (the
    names a notebook function reads, which already stand in the builtin's place in the notebook)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        return f"{name!r} is not a Python name"
    if name in LAB_NAMES:
        own = LAB_NAMES[name]
        if own is None or not isinstance(value, types.ModuleType) or value.__name__ != own:
            return f"{name} is the lab's own name on every rank: push it under another name"
    if name.startswith("__") and name.endswith("__"):
        # __builtins__, __name__ and the like are how Python runs the ranks' code: replaced, every later call breaks.
        return f"{name} is one of Python's own names (a dunder name), which the ranks' code needs as it is: " \
               f"push it under a plain name, e.g. lab.push(my_value=...)"
    if name in vars(builtins) and not callable(value) and not shadows_builtins:
        # A function (or class) in a builtin's place is a deliberate replacement; a value there breaks every use.
        return f"{name} is Python's builtin {name}(): a {type(value).__name__} in its place would break every " \
               f"later use of it on the ranks; push it under another name, e.g. lab.push(my_{name}=...)"
    return None


def pack_one(name: str, value, pushed_classes: dict[int, str]) -> tuple[dict, str, dict]:
    """(what a rank builds, how it travels in words, {cell: lines} for tracebacks); LabConfigError if it cannot."""
    if isinstance(value, types.ModuleType):
        module = module_name(value)
        if module is None:
            raise LabConfigError(f"{name} is a module that was not imported by a name the ranks could import "
                                 f"({getattr(value, '__name__', '?')!r}): import it on the ranks in a %%lab cell")
        return {"name": name, "how": "module", "module": module, "stage": MODULE}, f"module {module}", {}
    if isinstance(value, type) and from_notebook(value):
        found = class_statement(value)
        if found is None:
            raise LabConfigError(f"{name}: the class statement of {value.__qualname__} was not found in the "
                                 "notebook's cells; define it in a cell (or in a module file the ranks can import)")
        filename, lines, source = found
        item = {"name": name, "how": "class", "cell": filename, "source": source, "class_name": value.__name__,
                "stage": CLASS, "depth": len(value.__mro__)}  # a base class before the classes made from it
        return item, "by source", {filename: lines} if not os.path.exists(filename) else {}
    try:
        data, needs_classes = pickled(value, pushed_classes)
    except Exception as error:  # noqa: BLE001 - whatever pickle raises, the value cannot travel
        raise LabConfigError(f"{name} cannot travel to the ranks ({error}): values travel pickled; make locks, "
                             "open files, sockets, clients or generators on the ranks instead (in a %%lab cell, "
                             "or with a pushed function that makes them)") from None
    how = "by source" if from_notebook(value) else "by value"
    item = {"name": name, "how": "value", "data": data, "stage": NEEDS_CLASSES if needs_classes else VALUE}
    return item, how, notebook_sources(value) if how == "by source" else {}


def pack(values: dict, shadows_builtins: bool = False) -> tuple[list[dict], dict, list[tuple[str, str]]]:
    """(what the ranks build, in order; {cell: lines} for tracebacks; (name, how) in the order given).

    Every value is checked (``check_name``); LabConfigError names each one that cannot travel, and nothing is
    packed."""
    if not values:
        raise LabConfigError("nothing to push: name the values, e.g. lab.push(helper=helper, np=np)")
    pushed_classes = {id(value): name for name, value in values.items() if isinstance(value, type)
                      and from_notebook(value)}
    items, sources, said, problems = [], {}, [], []
    for name, value in values.items():
        problem = check_name(name, value, shadows_builtins)
        if problem is not None:
            problems.append(problem)
            continue
        try:
            item, how, cells = pack_one(name, value, pushed_classes)
        except LabConfigError as error:
            problems.append(str(error))
            continue
        items.append(item)
        sources.update(cells)
        said.append((name, how))
    if problems:
        raise LabConfigError("nothing was pushed: " + "; ".join(problems))
    items.sort(key=lambda item: (item["stage"], item.get("depth", 0)))  # stable: else in the order given
    return items, sources, said


def summary(said: list[tuple[str, str]], ranks: list[int], world_size: int) -> str:
    where = "every rank" if len(ranks) == world_size else format_ranks(ranks)
    return f"pushed to {where}: " + ", ".join(f"{name} ({how})" for name, how in said)


def push_values(session: Session, values: dict, ranks=None, timeout=None) -> None:
    """Send ``values`` ({name: value}) into the namespaces of ``ranks`` (None: every rank); say what was sent."""
    items, sources, said = pack(values)  # refused here, before any rank is asked
    reports = session.execute(ranks, entry.push, (items, sources), timeout)
    print(summary(said, sorted(reports), session.world_size))


def run_on(session: Session, ranks, fn, args: tuple, kwargs: dict, timeout=None) -> list:
    """``fn(*args, **kwargs)`` on ``ranks`` (None: every rank, as ``Session.run``); the results in rank order."""
    if ranks is None:
        return session.run(fn, *args, timeout=timeout, **kwargs)
    reports = session.execute(ranks, entry.call, (fn, args, kwargs, notebook_sources(fn)), timeout)
    return [reports[rank]["value"] for rank in sorted(reports)]
