"""Declarations found by entry points: the lab's own strategies and models, and any installed package's.

A package offers a strategy or a model by naming its declaration in an
entry-point group of its ``pyproject.toml``, the way labkit names its own::

    [project.entry-points."labkit.strategies"]
    local_sgd = "my_package.local_sgd:STRATEGY"

    [project.entry-points."labkit.models"]
    tiny = "my_package.tiny:MODEL"

Each process reads the groups for itself (the notebook, and every rank) when it
first needs them, and keeps what it loaded. A name it does not know makes it
read them again, so a package installed after the process started is found
too. Nothing is registered by a call: installing the package is enough. A
declaration written in a running notebook (a lesson, a first try) can still be
added with ``add``, in each process that uses it.

The groups are read with ``importlib.metadata``, the standard library's reader
of installed packages; a declaration module is imported only when its name is
asked for (or every one is listed), so the notebook pays for what it uses.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, distributions
from typing import Callable, Generic, Protocol, TypeVar


class PluginError(ValueError):
    """A name no installed package declares, one that two declare, or a declaration that does not load."""


class Declaration(Protocol):
    """What every declaration has: its name, and where it stands in lists of its kind."""

    @property
    def name(self) -> str: ...

    @property
    def list_position(self) -> int: ...


D = TypeVar("D", bound=Declaration)


def _points_of(group: str) -> list[EntryPoint]:
    """The group's entry points in every copy of every package's metadata on the path, first found first.

    ``entry_points()`` keeps only the first copy of a package's metadata. An old ``labkit.egg-info`` left
    in a checkout by an earlier install (before labkit declared its own strategies here) sits first on
    the path wherever Python runs from the checkout, and would hide every built-in strategy and model.
    A copy that declares a point adds it; one point declared alike by two copies counts once."""
    found: list[EntryPoint] = []
    seen: set[tuple[str, str, str]] = set()
    for distribution in distributions():
        for point in distribution.entry_points.select(group=group):
            key = (point.name, point.value, _package(point))
            if key not in seen:
                seen.add(key)
                found.append(point)
    return found


def _package(point: EntryPoint) -> str:
    return point.dist.name if point.dist is not None else "an unnamed package"


class PluginGroup(Generic[D]):
    """The declarations of one entry-point group in this process: read once, read again for a new name.

    ``kind`` names them in messages ("strategy", "model"); ``declared`` is their
    class, which a loaded object must be an instance of; ``prepare`` may complete
    a declaration with what its entry point says (the module it came from).
    """

    def __init__(self, group: str, kind: str, declared: type[D],
                 prepare: Callable[[D, EntryPoint], D] | None = None) -> None:
        self.group, self.kind, self.declared = group, kind, declared
        self.prepare = prepare
        self._lock = threading.RLock()  # the notebook's threads (a background run, a dashboard) may ask at once
        self._points: dict[str, list[EntryPoint]] | None = None  # name -> entry points: read, not yet imported
        self._loaded: dict[str, D] = {}
        self._added: dict[str, D] = {}  # by ``add``, in this process only

    # -- reading -------------------------------------------------------------

    def _read(self) -> dict[str, list[EntryPoint]]:
        if self._points is None:
            importlib.invalidate_caches()  # a folder put on sys.path, a package installed since the last read
            found: dict[str, list[EntryPoint]] = {}
            for point in _points_of(self.group):
                found.setdefault(point.name, []).append(point)
            self._points = found
        return self._points

    def refresh(self) -> None:
        """Forget what was read, so the next question reads the installed packages again (one was removed)."""
        with self._lock:
            self._points = None
            self._loaded.clear()

    def installed(self, name: str) -> bool:
        """Whether an installed package declares ``name`` (reading again when it is new)."""
        with self._lock:
            if name not in self._read():
                self._points = None
            return name in self._read()

    # -- asking --------------------------------------------------------------

    def get(self, name: str) -> D:
        """The declaration called ``name``; PluginError naming the known ones when none is."""
        with self._lock:
            if name in self._added:
                return self._added[name]
            if name not in self._loaded:
                if not self.installed(name):
                    raise PluginError(self.unknown(name))
                self._loaded[name] = self._load(name, self._read()[name])
            return self._loaded[name]

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._added or self.installed(name)

    def all(self) -> dict[str, D]:
        """Every declaration, in list order (``list_position``, then name)."""
        with self._lock:
            names = set(self._read()) | set(self._added)
            found = [self.get(name) for name in names]
        return {entry.name: entry for entry in sorted(found, key=lambda entry: (entry.list_position, entry.name))}

    def names(self) -> tuple[str, ...]:
        return tuple(self.all())

    def unknown(self, name: str) -> str:
        """Why ``name`` is not found, what is, and how another package's is installed."""
        return (f"no {self.kind} is called {name!r}; the known ones are {', '.join(self.names()) or 'none'}. "
                f"{self.install_hint()}")

    def install_hint(self) -> str:
        return (f"A {self.kind} from another package is found once that package is installed where labkit is "
                f"(pip install it): its pyproject.toml names the {self.kind} under "
                f"[project.entry-points.\"{self.group}\"]")

    def _load(self, name: str, points: list[EntryPoint]) -> D:
        packages = sorted({_package(point) for point in points})
        if len(packages) > 1:
            declared = "; ".join(f"{_package(point)} ({point.value})" for point in points)
            raise PluginError(f"two installed packages declare the {self.kind} {name!r}: {declared}. "
                              f"Uninstall one of them (pip uninstall), or ask its authors to rename theirs")
        point = points[0]
        where = f"the {self.kind} {name!r} of package {packages[0]} ({point.value})"
        try:
            declaration = point.load()
        except Exception as error:
            raise PluginError(f"{where} does not load: {type(error).__name__}: {error}") from error
        if not isinstance(declaration, self.declared):
            raise PluginError(f"{where} is a {type(declaration).__name__}, not a {self.declared.__name__}")
        if declaration.name != name:
            raise PluginError(f"{where} calls itself {declaration.name!r}: the entry point and the declaration "
                              f"must use one name")
        return self.prepare(declaration, point) if self.prepare is not None else declaration

    # -- declarations made in a running process ------------------------------

    def add(self, declaration: D) -> None:
        """Use ``declaration`` in this process as if a package declared it; the same one again is fine."""
        with self._lock:
            known = self._added.get(declaration.name)
            if known is None and self.installed(declaration.name):
                known = self.get(declaration.name)
            if known is not None and known != declaration:
                raise PluginError(f"a different {self.kind} is already called {declaration.name!r}")
            if known is None:
                self._added[declaration.name] = declaration

    def remove(self, name: str) -> None:
        """Forget a declaration ``add`` gave; an installed package's stays until the package is uninstalled."""
        with self._lock:
            if name in self._added:
                del self._added[name]
                return
            if self.installed(name):
                packages = ", ".join(sorted({_package(point) for point in self._read()[name]}))
                raise PluginError(f"the {self.kind} {name!r} is installed (package {packages}), not added in "
                                  f"this process: uninstall the package to remove it")
            raise PluginError(self.unknown(name))
