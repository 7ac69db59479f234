"""Run a script under a real ``torchrun``, to compare the lab with it.

``torchrun(script, *args, nproc=4)`` starts ``python -m torch.distributed.run
--standalone`` on this machine, waits with a deadline, and returns what the
workers printed and how long the launch took. A failed launch raises with the
end of torchrun's own error output, not only its exit status.

One failure is not the script's: a DDP worker over gloo can abort while the
interpreter shuts down, after its work is done and ``destroy_process_group()``
has returned, because gloo's worker thread drops the last collective's handle
(which holds Python objects) just as Python finalizes ("terminate called
without an active exception", see pytorch/pytorch#179291). It is a race, more
likely on a loaded machine (a fresh-clone CI run saw it twice in a row). When
every failed worker ended that way, the launch is repeated, up to
``EXIT_RACE_LAUNCHES`` launches in all, and ``TorchrunResult.retried`` says why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_RACE = "terminate called without an active exception"
EXIT_RACE_LAUNCHES = 3  # launches at most while only the exit race fails them


@dataclass(frozen=True)
class TorchrunResult:
    stdout: str
    stderr: str
    seconds: float  # the launch that succeeded, start to exit
    retried: str | None = None  # why the launch was repeated, or None

    def lines(self, prefix: str) -> list[str]:
        """The printed lines that start with ``prefix``."""
        return [line for line in self.stdout.splitlines() if line.startswith(prefix)]


class TorchrunFailed(RuntimeError):
    """torchrun exited with an error; the message ends with its own output."""


def exit_race_only(stderr: str) -> bool:
    """Whether the launch failed only because workers aborted in the interpreter's shutdown race:
    each failed worker either aborted (SIGABRT) saying so, or was stopped by torchrun (SIGTERM),
    and no worker printed a Python error (the one traceback is torchrun's own report)."""
    ended = {pid: int(code) for code, pid in re.findall(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", stderr)}
    aborted = [pid for pid, code in ended.items() if code == -signal.SIGABRT]
    return (bool(aborted) and all(code in (-signal.SIGABRT, -signal.SIGTERM) for code in ended.values())
            and stderr.count(EXIT_RACE) >= len(aborted)
            and stderr.count("Traceback (most recent call last)") <= 1)


def torchrun(script, *args: str, nproc: int = 4, timeout: float = 240.0, env: dict | None = None,
             threads: int = 1) -> TorchrunResult:
    """Run ``script`` with ``args`` under ``torchrun --standalone --nproc_per_node nproc``.

    ``threads``: ``OMP_NUM_THREADS`` for each worker (the lab's ranks use one each).
    The script runs in its own folder, as it would from a shell there.
    """
    script = Path(script).resolve()
    if not script.is_file():
        raise FileNotFoundError(f"no script at {script}")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc is a positive number of processes, got {nproc!r}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(script), *map(str, args)]
    environment = dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads))
    retried = None
    for attempt in range(EXIT_RACE_LAUNCHES):
        began = time.perf_counter()
        try:
            finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                      env=environment, cwd=script.parent)
        except subprocess.TimeoutExpired as error:
            raise TorchrunFailed(f"torchrun did not finish within {timeout:g} s (timeout)") from error
        seconds = time.perf_counter() - began
        if finished.returncode == 0:
            return TorchrunResult(finished.stdout, finished.stderr, seconds, retried)
        if attempt + 1 < EXIT_RACE_LAUNCHES and exit_race_only(finished.stderr):
            retried = ("a worker aborted in Python's shutdown after its work was done "
                       "(gloo's exit race, pytorch/pytorch#179291); launched again")
            continue
        break
    raise TorchrunFailed(f"torchrun exited with {finished.returncode}:\n{finished.stderr[-3000:]}")
