"""The notebook's working folder, umask and environment changes, taken on by a rank for user work.

A program under torchrun runs in the folder, with the umask and the environment
of the shell that launched it. A rank was started once, with the lab; so each
piece of user work brings the notebook's state at the time of the call
(``labkit.runs.notebook_process``), and the rank takes it on before the work:

- the working folder (for ranks on the notebook's machine; it stays for the next call);
- the umask, for the user's code only: outside it a rank keeps the lab's 077, so
  the lab's own files stay its owner's;
- the environment variables the notebook changed since the lab started. A variable
  carried once and no longer changed in the notebook gets back the rank's own value.

Runs in the engines.
"""

from __future__ import annotations

import contextlib
import os


class UserProcess:
    """What the notebook's last call asked of this rank's process."""

    def __init__(self) -> None:
        self.umask: int | None = None
        self._own_values: dict[str, str | None] = {}  # carried variable -> the rank's value before

    def take_on(self, state: dict, rank: int) -> None:
        """Take on the notebook's ``state`` (``NotebookProcess.state_for``); ``rank``: this rank, to say so."""
        self._carry(state.get("environment") or {})
        self.umask = state.get("umask")
        folder = state.get("cwd")
        if folder and folder != _current_folder():
            try:
                os.chdir(folder)
            except OSError as error:
                print(f"[labkit] rank {rank} cannot work in the notebook's folder {folder} ({error.strerror}); "
                      f"it works in {_current_folder()}", flush=True)

    def _carry(self, environment: dict[str, str | None]) -> None:
        for name in [name for name in self._own_values if name not in environment]:
            _set(name, self._own_values.pop(name))
        for name, value in environment.items():
            self._own_values.setdefault(name, os.environ.get(name))
            _set(name, value)

    @contextlib.contextmanager
    def user_umask(self):
        """The notebook's umask while the user's code runs, the lab's again after."""
        if self.umask is None:
            yield
            return
        previous = os.umask(self.umask)
        try:
            yield
        finally:
            os.umask(previous)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _current_folder() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the folder was removed under the rank
        return None
