"""Declarations of strategies and models: the lab's own, and any installed package's, found by entry points.

labkit's own strategies and models are named in its code (``built_in``), so
they are there however labkit is on the path: installed, or a checkout on
``PYTHONPATH`` with no package metadata at all. A package offers one more by
naming its declaration in an entry-point group of its ``pyproject.toml``::

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

A package's declaration that does not load (its module raises, it names a
missing attribute, its entry point is malformed, it is no declaration, two
packages claim one name) breaks only itself: it is left out of the lists, the
others work, and asking for it by name raises ``PluginError`` with its error and
the remedy (``pip uninstall`` naming its package); ``notes`` says the same for
every one of them, for help texts.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, distributions
from collections.abc import Mapping
from typing import Callable, Generic, Protocol, TypeVar


class PluginError(ValueError):
    """A name no installed package declares, one that two declare, or a declaration that does not load."""


LABKIT = "labkit"  # the package of the built-in declarations


class Declaration(Protocol):
    """What every declaration has: its name, and where it stands in lists of its kind."""

    @property
    def name(self) -> str: ...

    @property
    def list_position(self) -> int: ...


D = TypeVar("D", bound=Declaration)


def _points_of(group: str) -> list[EntryPoint]:
    """The group's entry points in every copy of every package's metadata on the path, first found first.

    ``entry_points()`` keeps only the first copy of a package's metadata: an old copy of a package's
    metadata first on the path (an ``egg-info`` an earlier install left in a checkout) would hide the
    points its installed copy declares. A copy that declares a point adds it; one point declared alike
    by two copies counts once."""
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


def _remedy(packages: list[str]) -> str:
    """How to be rid of a broken declaration: uninstall its package (or one of two that clash)."""
    named = [package for package in packages if package not in (LABKIT, "an unnamed package")]
    if not named:
        return "remove the package that declares it from the path"
    if len(named) == 1:
        return f"pip uninstall {named[0]}, or install a fixed version of it"
    return f"pip uninstall one of {', '.join(named)}, or ask their authors to rename theirs"


class PluginGroup(Generic[D]):
    """The declarations of one entry-point group in this process: read once, read again for a new name.

    ``kind`` names them in messages ("strategy", "model"); ``declared`` is their
    class, which a loaded object must be an instance of; ``built_in``: labkit's
    own, name -> ``"module:ATTRIBUTE"``, found in its code, never through entry
    points; ``prepare`` may complete a declaration with what its entry point
    says (the module it came from) or refuse it (``PluginError``).
    """

    def __init__(self, group: str, kind: str, declared: type[D], built_in: Mapping[str, str] | None = None,
                 prepare: Callable[[D, EntryPoint], D] | None = None) -> None:
        self.group, self.kind, self.declared = group, kind, declared
        self.built_in = dict(built_in or {})
        self.prepare = prepare
        self._lock = threading.RLock()  # the notebook's threads (a background run, a dashboard) may ask at once
        self._points: dict[str, list[EntryPoint]] | None = None  # name -> entry points: read, not yet imported
        self._loaded: dict[str, D] = {}
        self._broken: dict[str, str] = {}  # name -> why it does not load, and the remedy (until read again)
        self._shadowing: list[str] = []  # packages' entry points that take a built-in's name: said, not used
        self._added: dict[str, D] = {}  # by ``add``, in this process only

    # -- reading -------------------------------------------------------------

    def _read(self) -> dict[str, list[EntryPoint]]:
        if self._points is None:
            importlib.invalidate_caches()  # a folder put on sys.path, a package installed since the last read
            found: dict[str, list[EntryPoint]] = {}
            shadowing = []
            for point in _points_of(self.group):
                if point.name not in self.built_in:
                    found.setdefault(point.name, []).append(point)
                elif point.value != self.built_in[point.name]:
                    shadowing.append(f"{_package(point)} also declares a {self.kind} {point.name!r} "
                                     f"({point.value}); labkit's own is used: {_remedy([_package(point)])}")
                # else: labkit's own metadata (an install that still names its built-ins): the built-in itself
            self._points, self._shadowing = found, shadowing
            self._broken.clear()  # read again: a package fixed or removed since is tried afresh
        return self._points

    def refresh(self) -> None:
        """Forget what was read, so the next question reads the installed packages again (one was removed)."""
        with self._lock:
            self._points = None
            self._loaded.clear()
            self._broken.clear()

    def installed(self, name: str) -> bool:
        """Whether labkit or an installed package declares ``name`` (reading again when it is new)."""
        with self._lock:
            if name in self.built_in:
                return True
            if name not in self._read():
                self._points = None
            return name in self._read()

    # -- asking --------------------------------------------------------------

    def get(self, name: str) -> D:
        """The declaration called ``name``; PluginError naming the known ones when none is, or saying why
        it does not load and what to do."""
        with self._lock:
            if name in self._added:
                return self._added[name]
            if name not in self._loaded:
                if not self.installed(name):
                    raise PluginError(self.unknown(name))
                self._broken.pop(name, None)  # asked by name: tried again (its package may be fixed)
                try:
                    self._loaded[name] = self._load(name, self._points_for(name))
                except PluginError as error:
                    self._broken[name] = str(error)
                    raise
            return self._loaded[name]

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._added or self.installed(name)

    def all(self) -> dict[str, D]:
        """Every declaration that loads, in list order (``list_position``, then name); the others are left
        out (``notes`` says why)."""
        with self._lock:
            names = set(self.built_in) | set(self._read()) | set(self._added)
            found = []
            for name in names:
                if name in self._broken and name not in self._added:
                    continue
                try:
                    found.append(self.get(name))
                except PluginError:  # a package's breaks only itself: said when asked for, and in notes()
                    if name in self.built_in:
                        raise  # labkit's own: a bug in labkit, never left out in silence
                    continue
        return {entry.name: entry for entry in sorted(found, key=lambda entry: (entry.list_position, entry.name))}

    def names(self) -> tuple[str, ...]:
        return tuple(self.all())

    def notes(self) -> tuple[str, ...]:
        """One line for each installed declaration that is not used: why, and what to do."""
        with self._lock:
            self.all()
            return (*(self._broken[name] for name in sorted(self._broken)), *self._shadowing)

    def unknown(self, name: str) -> str:
        """Why ``name`` is not found, what is (and what does not load), and how another package's is installed."""
        known = ', '.join(self.names()) or 'none'
        return (f"no {self.kind} is called {name!r}; the known ones are {known}.{self.not_loading()} "
                f"{self.install_hint()}")

    def remedy(self, name: str) -> str:
        """How to be rid of the installed declaration ``name``: uninstall its package."""
        with self._lock:
            if name in self.built_in or name in self._added or name not in self._read():
                return "unregister it, or rename it"
            return _remedy(sorted({_package(point) for point in self._read()[name]}))

    def not_loading(self) -> str:
        """' Installed but not loading: NAME (ask for it by name to see why).', or '' when every one loads."""
        with self._lock:
            self.all()
            broken = sorted(self._broken)
        if not broken:
            return ""
        return f" Installed but not loading: {', '.join(broken)} (ask for it by name to see why, and what to do)."

    def install_hint(self) -> str:
        return (f"A {self.kind} from another package is found once that package is installed where labkit is "
                f"(pip install it): its pyproject.toml names the {self.kind} under "
                f"[project.entry-points.\"{self.group}\"]")

    def _points_for(self, name: str) -> list[EntryPoint]:
        """Where ``name`` is declared: labkit's own code for a built-in, else the packages' entry points."""
        if name in self.built_in:
            return [EntryPoint(name=name, value=self.built_in[name], group=self.group)]
        return self._read()[name]

    def _load(self, name: str, points: list[EntryPoint]) -> D:
        packages = sorted({LABKIT if name in self.built_in else _package(point) for point in points})
        if len(packages) > 1:
            declared = "; ".join(f"{_package(point)} ({point.value})" for point in points)
            raise PluginError(f"two installed packages declare the {self.kind} {name!r}: {declared}. "
                              f"To use one: {_remedy(packages)}")
        point = points[0]
        where = f"the {self.kind} {name!r} of package {packages[0]}"
        others = f"{self.kind[:-1]}ies" if self.kind.endswith("y") else f"{self.kind}s"
        remedy = f"; the other {others} work. To be rid of it: {_remedy(packages)}"
        if not point.pattern.match(point.value):
            raise PluginError(f"{where} is declared as {point.value!r}, which is no 'module:attribute' (such as "
                              f"'my_package.module:STRATEGY'){remedy}")
        where = f"{where} ({point.value})"
        try:
            declaration = point.load()
        except Exception as error:
            raise PluginError(f"{where} does not load: {type(error).__name__}: {error}{remedy}") from error
        if not isinstance(declaration, self.declared):
            raise PluginError(f"{where} is a {type(declaration).__name__}, not a {self.declared.__name__}{remedy}")
        if declaration.name != name:
            raise PluginError(f"{where} calls itself {declaration.name!r}: the entry point and the declaration "
                              f"must use one name{remedy}")
        if self.prepare is None:
            return declaration
        try:
            return self.prepare(declaration, point)
        except PluginError as error:
            raise PluginError(f"{error}{remedy}") from None

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
                packages = LABKIT if name in self.built_in else \
                    ", ".join(sorted({_package(point) for point in self._read()[name]}))
                raise PluginError(f"the {self.kind} {name!r} is installed (package {packages}), not added in "
                                  f"this process: uninstall the package to remove it")
            raise PluginError(self.unknown(name))
