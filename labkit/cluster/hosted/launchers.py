"""ipyparallel launchers that fork the controller and engines from the process host.

They are ordinary ipyparallel ``Launcher`` classes: the ``Cluster`` drives them
exactly as it drives its own local launchers (start, signal, stop, notice exit),
only the process comes from ``ProcessHost.spawn`` instead of ``Popen``. The
transport stays ipyparallel's; past one machine the lab uses ipyparallel's own
MPI/SSH/Slurm launchers instead of these.
"""

from __future__ import annotations

import psutil
from ipyparallel.cluster.launcher import LocalControllerLauncher, LocalEngineLauncher, LocalProcessLauncher
from traitlets import Any, Float


class _HostedProcess(LocalProcessLauncher):
    """Mixin: replace ``Popen`` in ``LocalProcessLauncher.start`` by a fork from the host."""

    host = Any(help="the labkit ProcessHost that forks this process")
    spawn_timeout = Float(120.0, help="seconds to wait for the host to fork the process")
    entry = "engine"

    def start(self):
        if self.state != "before":
            raise RuntimeError(f"the {self.entry} was already started (state: {self.state})")
        # The command's first three words are "python -m <module>"; the host runs
        # that module's main() in a fork, so only the arguments travel.
        argv = list(self.args[3:])
        pid = self.host.spawn(self.entry, argv, dict(self.get_env()), self.output_file, self.spawn_timeout)
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()


class HostedControllerLauncher(_HostedProcess, LocalControllerLauncher):
    """The ipyparallel controller, forked from the process host."""

    entry = "controller"


class HostedEngineLauncher(_HostedProcess, LocalEngineLauncher):
    """One engine (one rank), forked from the process host.

    Used as an engine *set* of one: one set per rank lets one rank be signalled,
    stopped or replaced without touching the others.
    """

    entry = "engine"

    def start(self, n: int = 1):
        if n != 1:
            raise ValueError("a hosted engine set holds exactly one engine (one rank)")
        self.n = 1
        return super().start()
