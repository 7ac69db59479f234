"""ipyparallel's SSH engine launcher, as the lab uses it: one ssh connection per host, shared by its engines.

ipyparallel's launcher starts one engine after another, each with ssh sessions of its own: the remote
shell's kind, a python check, ``ipython profile create`` on the host, the connection files, the start;
then each engine keeps a session open that waits on its process. Every session is a new ssh connection,
about 0.3 s of key exchange on a fast network (more across a real one). ``SshEngineSet`` changes two things,
and nothing else of ipyparallel's launcher:

- its engines share one ssh connection per host (OpenSSH's own connection sharing: ``ControlMaster=auto``
  with the socket among the lab's files, and ``ControlPersist`` so the shared connection ends by itself
  a few seconds after its last session), unless ``ssh_args`` already choose a ``ControlMaster`` or a
  ``ControlPath``;
- a host is asked for its shell and its python, and its profile folder made, once per host and folder
  rather than once per engine.
"""

from __future__ import annotations

import os
import threading

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from ipyparallel.cluster.shellcmd import ShellCommandSend

# Seconds the shared connection to a host outlives its last session: the engines' own sessions keep it
# open while they run; after the lab stops, nothing of it stays longer than this, here or on the host.
PERSIST_SECONDS = 5
ALIVE_SECONDS = 2


def shared_connection_args(folder: str, given: list[str]) -> list[str]:
    """ssh options that share one connection per host (socket in ``folder``), unless ``given`` choose their own."""
    if any(word.lower().startswith(("controlmaster", "controlpath")) for word in given):
        return []
    # A shared connection to a host that is cut off would hold every session on it until TCP gives up
    # (many minutes): keep-alives end it within ALIVE_SECONDS x 3, and its sessions with it.
    return ["-o", "ControlMaster=auto", "-o", f"ControlPath={os.path.join(folder, 'ssh-%C')}",
            "-o", f"ControlPersist={PERSIST_SECONDS}", "-o", f"ServerAliveInterval={ALIVE_SECONDS}",
            "-o", "ServerAliveCountMax=3"]


class HostShell(ShellCommandSend):
    """ipyparallel's remote shell, shared by the engines of one host: what it learns of the host once, it keeps."""

    def __init__(self, *args, **kwargs) -> None:
        # Before ipyparallel's __init__, which asks the host for its shell already.
        self._lock = threading.Lock()
        self._python: bool | None = None
        self._profiles: set[tuple] = set()
        super().__init__(*args, **kwargs)

    def initialize(self):
        with self._lock:
            super().initialize()

    def has_python(self, python_path=None):
        if python_path not in (None, self.python_path):
            return super().has_python(python_path)
        with self._lock:
            if self._python is None:
                self._python = super().has_python()
            return self._python

    def check_output_python_module(self, module_params, **kwargs):
        if list(module_params[:3]) != ["IPython", "profile", "create"]:
            return super().check_output_python_module(module_params, **kwargs)
        made = tuple(module_params)
        with self._lock:  # the same profile folder on the same host: made once
            if made not in self._profiles:
                super().check_output_python_module(module_params, **kwargs)
                self._profiles.add(made)
        return ""


class SshEngine(SSHEngineLauncher):
    """One engine on one host, through the shell its engine set keeps for that host."""

    @property
    def ssh_sender(self):
        if self._ssh_sender is None:
            owner = self.parent if isinstance(self.parent, SshEngineSet) else None
            self._ssh_sender = owner.shell_for(self) if owner is not None else HostShell(
                self.ssh_cmd, self.ssh_args + [self.location], self.remote_python, log=self.log)
        return self._ssh_sender


class SshEngineSet(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set launcher as the lab uses it; see the module docstring."""

    launcher_class = SshEngine

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for options in ("ssh_args", "scp_args") if self.profile_dir else ():
            given = list(getattr(self, options))
            setattr(self, options, [*given, *shared_connection_args(self.profile_dir, given)])
        self._shells: dict[tuple, HostShell] = {}
        self._shells_lock = threading.Lock()

    def shell_for(self, engine: SSHEngineLauncher) -> HostShell:
        """The shell of ``engine``'s host (and ssh options, and python), made at its first engine."""
        key = (tuple(engine.ssh_cmd), tuple(engine.ssh_args), engine.location, engine.remote_python)
        with self._shells_lock:
            if key not in self._shells:
                self._shells[key] = HostShell(engine.ssh_cmd, [*engine.ssh_args, engine.location],
                                              engine.remote_python, log=engine.log)
            return self._shells[key]
