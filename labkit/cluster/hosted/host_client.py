"""The owner's side of the process host: start it, ask it for children, stop it.

The host (``labkit.cluster.hosted.process_host``) runs in its own process and
speaks JSON lines on its stdin and stdout; ``ProcessHost`` writes the requests,
reads the replies on a thread of its own, and keeps the exit codes of the
children the host reports ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future

class HostError(RuntimeError):
    """The process host could not start or could not fork a child."""


class ProcessHost:
    """Starts the host process and asks it for children; ``stop()`` ends them all."""

    def __init__(self, log_path: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen | None = None
        self.exit_codes: dict[int, int] = {}
        self.capabilities: Future = Future()
        self.warmed: Future | None = None  # once asked (warm): done when the host has imported WARM_MODULES
        self._replies: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def start(self) -> "ProcessHost":
        env = dict(os.environ if self.env is None else self.env)
        # Its owner's only, like every file of the lab.
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "labkit.cluster.hosted.process_host"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
                text=True,
                bufsize=1,
            )
        threading.Thread(target=self._read_replies, name="labkit-host-replies", daemon=True).start()
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _read_replies(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            event = message.get("event")
            if event == "exit":
                self.exit_codes[message["pid"]] = message["code"]
            elif event == "ready":
                self.capabilities.set_result(message)
            else:
                with self._lock:
                    future = self._replies.pop(message.get("id"), None)
                if future is not None:
                    future.set_result(message)
        # The host is gone: nobody will answer what is still pending.
        failure = HostError(f"the process host exited (log: {self.log_path})")
        with self._lock:
            pending, self._replies = list(self._replies.values()), {}
        if not self.capabilities.done():
            self.capabilities.set_exception(failure)
        for future in pending:
            future.set_exception(failure)

    def request_spawn(
        self, entry: str, argv: list[str], env: dict[str, str], log: str, cwd: str | None = None
    ) -> Future:
        """Ask for a child; the future resolves to its pid."""
        if self.process is None or self.process.poll() is not None:
            raise HostError(f"the process host is not running (log: {self.log_path})")
        future: Future = Future()
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            self._replies[request_id] = future
        request = {"id": request_id, "entry": entry, "argv": argv, "env": env, "log": log, "cwd": cwd}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return future

    def warm(self) -> Future:
        """Ask the host to import what ranks need later (children forked after it start with it), while
        the ranks are idle; the future is done once every module is imported."""
        self.warmed = self.request_spawn("warm", [], {}, os.devnull)
        return self.warmed

    def spawn(self, entry: str, argv: list[str], env: dict[str, str], log: str, timeout: float) -> int:
        try:
            reply = self.request_spawn(entry, argv, env, log, cwd=os.getcwd()).result(timeout)
        except TimeoutError:
            raise HostError(f"the process host did not start the {entry} within {timeout:.1f} s") from None
        if "error" in reply:
            raise HostError(f"could not start the {entry}: {reply['error']}")
        return reply["pid"]

    def stop(self, timeout: float = 10.0) -> None:
        """Close the host's input: it terminates its children and exits."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            if process.stdin:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
