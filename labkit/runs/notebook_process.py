"""The notebook's process state that user work on the ranks runs in: its folder, umask and environment.

A script under torchrun runs in the folder, with the umask and the environment
of the shell that launched it. The lab's ranks were started once, with the lab,
so the notebook's state at the time of each call travels with the work
(``labkit.rank.user_process`` takes it on, on the rank):

- its working folder and its umask, to the ranks on the notebook's machine (a
  rank elsewhere keeps its own: the folder may not exist there, and its files
  follow that machine's settings);
- the environment variables it set, changed or unset since the lab started, to
  every rank, except those the lab sets per rank itself (``RANK``, ``MASTER_PORT``,
  ...). Which were carried is said in one line, when that changes; names only,
  since values may be secrets.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import socket

# Variables the lab sets on each rank itself, which the notebook's must not overwrite.
LAB_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG",
})
LAB_PREFIXES = ("TORCHELASTIC_", "LABKIT_", "IPP_")


def carried(name: str) -> bool:
    """Whether a change of the notebook's variable ``name`` goes to the ranks."""
    return name not in LAB_VARIABLES and not name.startswith(LAB_PREFIXES)


def current_umask() -> int:
    """This process's umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


class NotebookProcess:
    """The notebook's environment when the lab started, and its state at each call."""

    def __init__(self) -> None:
        self.started_with = dict(os.environ)
        self.host = socket.gethostname()
        self._said: tuple = ()

    def environment_changes(self) -> dict[str, str | None]:
        """{name: value} of the variables changed since the lab started; None for one unset since."""
        now = os.environ
        changes: dict[str, str | None] = {name: value for name, value in now.items()
                                          if self.started_with.get(name) != value}
        changes.update({name: None for name in self.started_with if name not in now})
        return {name: changes[name] for name in sorted(changes) if carried(name)}

    def state(self) -> dict:
        """What the ranks on this machine take on before the work; says which variables travel."""
        environment = self.environment_changes()
        self._say(environment)
        try:
            folder = os.getcwd()
        except OSError:  # the notebook's folder was removed: the ranks keep theirs
            folder = None
        return {"cwd": folder, "umask": current_umask(), "environment": environment}

    def state_for(self, state: dict, record) -> dict:
        """``state`` as the rank of ``record`` (a ``RankRecord``) takes it: all of it on this machine, the
        environment alone elsewhere (a machine that joined counts as elsewhere)."""
        if record is not None and record.host == self.host and not getattr(record, "joined", False):
            return state
        return {"environment": state["environment"]}

    def _say(self, environment: dict[str, str | None]) -> None:
        changed = tuple((name, value is not None) for name, value in environment.items())
        if changed == self._said:
            return
        self._said = changed
        if not changed:
            return
        parts = []
        for is_set, word in ((True, "set"), (False, "unset")):
            names = [name for name, was_set in changed if was_set is is_set]
            if names:
                parts.append(f"{', '.join(names)} {word}")
        print(f"labkit: the ranks get the notebook's environment changes since the lab started: {'; '.join(parts)}",
              flush=True)
