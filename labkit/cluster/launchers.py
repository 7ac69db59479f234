"""Which ipyparallel launcher starts a lab's engines, and with which of its options.

A launcher is named as ipyparallel names it (its ``ipyparallel.engine_launchers``
entry point): "hosted" is the lab's own fast launcher on this machine (registered
there by labkit's package metadata), "mpi", "ssh", "slurm", "pbs", "sge", "lsf",
"local" are ipyparallel's. Options are that launcher's own configurable traits
(``mpi_args``, ``engines``, ``batch_template``, ...), passed to it unchanged, so
ipyparallel's documentation for each launcher holds here too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from labkit.spec.errors import LabConfigError

HOSTED = "hosted"
# Launchers whose engines run on this machine: its cores, memory and GPUs bound the lab.
ON_THIS_MACHINE = (HOSTED, "local")


@dataclass(frozen=True)
class LauncherChoice:
    """A launcher by name, its engine-set class and the options passed to it."""

    name: str
    engine_class: type[Any]  # an ipyparallel launcher class
    options: dict = field(default_factory=dict)

    @property
    def hosted(self) -> bool:
        return self.name == HOSTED

    @property
    def on_this_machine(self) -> bool:
        return self.name in ON_THIS_MACHINE

    def config(self):
        """The options as traitlets configuration of the launcher's class."""
        from traitlets.config import Config

        return Config({self.engine_class.__name__: dict(self.options)})

    def set_options(self, environment: dict, engine_args: list[str], output_file: str,
                    host: str | None = None) -> dict:
        """What one engine set is started with besides its count: the lab's ``environment`` and ``engine_args``
        beside the user's, its log file where the launcher writes one, and where the launcher names hosts
        (ssh's ``engines``) each host's engines told their host; ``host``: a replacement goes there alone."""
        environment = {**self.options.get("environment", {}), **environment}
        options: dict[str, object] = {"environment": environment,
                                      "engine_args": [*self.options.get("engine_args", []), *engine_args]}
        if "output_file" in self.engine_class.class_trait_names():
            options["output_file"] = output_file
        if isinstance(self.options.get("engines"), dict):
            options["engines"] = engines_by_host(self.options["engines"], environment, host)
        return options

    def check_room(self, ranks: int) -> None:
        """Refuse ``ranks`` that a launcher naming its hosts (ssh's ``engines``) has no room for: it would start
        fewer engines and the lab would wait out its start_timeout for the rest."""
        if "engines" not in self.engine_class.class_trait_names(config=True):
            return
        room = engines_room(self.options.get("engines", {}))
        if room < ranks:
            example = "engines={'node1': 2, 'node2': 2}"
            raise LabConfigError(f"the {self.name} launcher starts engines on the hosts of its engines option "
                                 f"({room} engine(s) there now), and ranks={ranks} needs {ranks}: give them, e.g. "
                                 f"{example}")

    def describe(self) -> str:
        shown = ", ".join(f"{key}={value!r}" for key, value in sorted(self.options.items()))
        return self.name + (f" ({shown})" if shown else "")


def _hosted_class() -> type[Any]:
    from labkit.cluster.hosted.launchers import HostedEngineLauncher

    return HostedEngineLauncher


def _slurm_class() -> type[Any]:
    from labkit.cluster.slurm import SlurmEngineSet

    return SlurmEngineSet


def _ssh_class() -> type[Any]:
    from labkit.cluster.ssh import SshEngineSet

    return SshEngineSet


# Launchers the lab replaces with its own subclass of ipyparallel's (same options, see each module).
OWN_CLASSES = {HOSTED: _hosted_class, "slurm": _slurm_class, "ssh": _ssh_class}


def launcher_names() -> list[str]:
    from ipyparallel.traitlets import entry_points

    return sorted({HOSTED} | {point.name.lower() for point in entry_points(group="ipyparallel.engine_launchers")})


def choose_launcher(name: str = HOSTED, **options) -> LauncherChoice:
    """The launcher ``name`` with ``options``, checked now: an unknown name or option is refused, listing
    what there is."""
    from ipyparallel.cluster.launcher import find_launcher_class
    from traitlets import TraitError

    if not isinstance(name, str) or not name:
        raise LabConfigError(f"launcher is a name such as 'hosted', 'mpi', 'ssh' or 'slurm', got {name!r}")
    try:
        # The lab's own by import, not only through its entry point: that needs labkit installed, not just present.
        own = OWN_CLASSES.get(name.lower())
        engine_class = own() if own is not None else find_launcher_class(name, "engine")
    except KeyError:
        raise LabConfigError(f"unknown launcher {name!r}: choose one of {', '.join(launcher_names())} "
                             "(ipyparallel's engine launchers, and labkit's own 'hosted')") from None
    known = set(engine_class.class_trait_names(config=True))
    unknown = sorted(set(options) - known)
    if unknown:
        raise LabConfigError(f"the {name} launcher has no option {', '.join(unknown)}; its options are: "
                             f"{', '.join(sorted(known))}")
    options = dict(options)
    if name.lower() == "mpi" and "mpi_cmd" not in options and shutil.which("mpiexec") is None:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")  # MPI from pip (mpich's wheel)
        if os.access(beside, os.X_OK):
            options["mpi_cmd"] = [beside]
    choice = LauncherChoice(name.lower(), engine_class, options)
    # The launcher checks its own options' types now, not when the lab starts. A batch launcher makes
    # its log folder under its profile directory as it is built: a scratch one here, so that checking
    # (and refusing) leaves nothing behind in the current directory.
    with tempfile.TemporaryDirectory(prefix="labkit-launcher-check-") as scratch:
        try:
            launcher = engine_class(config=choice.config(), profile_dir=scratch)
        except TraitError as error:
            raise LabConfigError(f"the {name} launcher refused its options: {error}") from None
        _check_commands(name, launcher)
    return choice


def engines_room(engines) -> int:
    """How many engines ipyparallel's ``engines`` option starts (host -> count, or -> {"n": count, ...}); what
    it would misread is refused, naming the host."""
    if not isinstance(engines, dict):
        raise LabConfigError(f"engines is a dict of host -> number of engines, e.g. {{'node1': 2}}, not {engines!r}")
    room = 0
    for host, entry in engines.items():
        count = entry.get("n", 1) if isinstance(entry, dict) else entry
        if not isinstance(host, str) or not host or isinstance(count, bool) or not isinstance(count, int) \
                or count < 1:
            raise LabConfigError(f"engines: {host!r} -> {entry!r} is not a host name and a whole number of engines "
                                 "of at least 1 (or {'n': N, other ssh options})")
        room += count
    return room


def engines_by_host(engines: dict, environment: dict, only: str | None = None) -> dict:
    """ipyparallel's ``engines`` option (host -> count, or -> {"n": count, other options}) with every host's
    engines told their host entry (``LABKIT_LAUNCHED_ON`` beside the set's ``environment``), so the lab knows
    where each rank was started. ``only``: one engine on that host alone (a rank replaced where it ran); a
    host that is no longer among them gets what ipyparallel would do with one engine: the first host's."""
    from labkit.wire.entry import LAUNCHED_ON_VARIABLE

    chosen = {}
    for host, entry in engines.items():
        if only is not None and host != only:
            continue
        config = dict(entry) if isinstance(entry, dict) else {"n": entry}
        config["environment"] = {**environment, **config.get("environment", {}), LAUNCHED_ON_VARIABLE: host}
        if only is not None:
            config["n"] = 1
        chosen[host] = config
    return chosen if chosen else engines_by_host(engines, environment)


def signal_one_engine(engine_set, record, signum: int) -> None:
    """Signal one engine of an engine set through its own launcher, by the rank's ``record`` (pid, host, host
    entry): ssh's ``kill`` on the host it was started on, or a Slurm job step beside it on its node. An engine
    the controller dropped (frozen, say) still gets the SIGKILL that replaces it."""
    signal_task = getattr(engine_set, "signal_task", None)
    if signal_task is not None:
        signal_task(record.pid, record.host, signum)
        return
    launched_on = record.launched_on or ""
    for each in getattr(engine_set, "launchers", {}).values():
        host = str(getattr(each, "hostname", "") or "")
        if getattr(each, "pid", None) == record.pid and host and host in launched_on:
            with contextlib.suppress(Exception):  # it ended already
                each.signal(signum)


# The traits of ipyparallel's launchers that name a program this machine runs to start engines.
COMMAND_TRAITS = {"mpi_cmd": "MPI", "ssh_cmd": "SSH", "submit_command": "the batch system"}


def _check_commands(name: str, launcher) -> None:
    """Refuse, before anything starts, a launcher whose program is not on this machine."""
    for trait, what in COMMAND_TRAITS.items():
        command = getattr(launcher, trait, None)
        if command and shutil.which(command[0]) is None:
            raise LabConfigError(f"the {name} launcher runs {command[0]!r}, which is not on this machine's PATH: "
                                 f"install {what} (or give the program's path: {trait}=['/path/to/{command[0]}'])")
