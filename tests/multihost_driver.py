"""The notebook side of the multi-host tests, run inside one network-namespace host, and its client.

Run as a script, it reads one JSON command per line on stdin and answers one
line on stdout, so a test (outside every namespace) can drive a real ``Lab``
whose controller listens on that host's address while engines join from the
others. ``DriverClient`` is that test's side. Also used by ``bench/multihost.py`` and, with its "exec"
command (Python run in the driver, with the lab), by the sites' namespace test.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback


ANSWER = "@@answer "  # the lab prints notes too: answers are the lines that start with this


def answer(**reply) -> None:
    print(ANSWER + json.dumps(reply), flush=True)


class DriverError(RuntimeError):
    """The driver did not answer in time, or exited."""


class DriverClient:
    """Runs this module in host 0 of ``hosts`` and asks it one command at a time."""

    def __init__(self, hosts, name: str = "lab", environment: dict | None = None, stderr=None):
        """``environment``: added to the driver's; ``stderr``: where the driver's goes (by default, the caller's)."""
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1", IPP_NONINTERACTIVE="1", **(environment or {}))
        self.process = hosts.popen(0, [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        # A thread reads the lines: select() on the pipe would miss a line that readline() already
        # pulled into the file object's buffer (an answer arriving with the print before it), and wait forever.
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{name}-driver-output", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the driver exited

    def ask(self, answer_within: float, **command) -> dict:
        """Send ``command``; its answer, with what the lab printed before it under "printed"."""
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + answer_within
        printed = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DriverError(f"{self.name} lab: no answer to {command['command']} within {answer_within} s; "
                                  f"it printed: {''.join(printed)[-2000:]}") from None
            if line is None:
                self.lines.put(None)  # still exited for the next ask
                raise DriverError(f"{self.name} lab: the driver exited (code {self.process.poll()}) during "
                                  f"{command['command']}; it printed: {''.join(printed)[-2000:]}")
            if line.startswith(ANSWER):
                return {**json.loads(line[len(ANSWER):]), "printed": "".join(printed)}
            printed.append(line)


def all_reduce_sums(rounds: int = 20, numel: int = 1 << 14):
    import torch
    import torch.distributed as dist

    tensor = torch.ones(numel)
    for _ in range(rounds):
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
    return float(tensor[0])


def main() -> None:
    from labkit import Lab

    lab = None
    scope: dict = {}  # what "exec" commands keep between them
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("command")
        began = time.monotonic()
        try:
            if name == "start":
                lab = Lab(**command).start()
                answer(ok=True, join=lab.join_command(python=sys.executable), plan=lab.plan.describe(),
                       seconds=time.monotonic() - began)
            elif name == "grow":  # heal until the joined engines are ranks
                deadline = time.monotonic() + command["within"]
                while lab.world_size < command["world"] and time.monotonic() < deadline:
                    lab.heal()  # prints what it did: the test reads it among the lines it skips
                    time.sleep(0.2)
                answer(ok=True, world=lab.world_size, seconds=time.monotonic() - began,
                       places=[lab.cluster.place_of(rank) for rank in range(lab.world_size)],
                       hosts=[lab.cluster.records[rank].host for rank in range(lab.world_size)])
            elif name == "all_reduce":
                sums = lab.run(all_reduce_sums, command.get("rounds", 20), timeout=command.get("timeout"))
                answer(ok=True, sums=sums, world=lab.world_size, seconds=time.monotonic() - began)
            elif name == "train":
                report = lab.train(timeout=command.pop("timeout", None), **command)
                answer(ok=True, losses=report.losses, equivalent=report.equivalent, world=lab.world_size,
                       step_seconds=report.median_step_seconds, text=str(report), seconds=time.monotonic() - began)
            elif name == "bench":
                result = lab.bench_collective("all_reduce", sizes=command["sizes"], iterations=command["iters"])
                answer(ok=True, rows=result.rows(), seconds=time.monotonic() - began)
            elif name == "listening":
                answer(ok=True, listening=lab.cluster.listening_addresses())
            elif name == "status":
                answer(ok=True, status=str(lab.status()), world=lab.world_size)
            elif name == "exec":  # a few lines of Python with ``lab`` (and what earlier ones made); ``result`` is sent
                scope.update(lab=lab)
                exec(command["code"], scope)
                lab = scope.get("lab", lab)
                answer(ok=True, result=scope.pop("result", None), seconds=time.monotonic() - began)
            elif name == "stop":
                lab.stop()
                answer(ok=True, seconds=time.monotonic() - began)
                return
            else:
                answer(ok=False, error=f"unknown command {name}")
        except Exception as error:  # noqa: BLE001 - the test reads what failed
            answer(ok=False, error=f"{type(error).__name__}: {error}", trace=traceback.format_exc(),
                   seconds=time.monotonic() - began, world=lab.world_size if lab else None)


if __name__ == "__main__":
    main()
