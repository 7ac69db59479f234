"""A warm parent process that forks the lab's controller and rank engines.

Importing torch costs a few CPU-seconds per process. A lab of N ranks started the
usual way pays it N times, all at once, on however few cores the machine has. The
process host pays it once: it imports the heavy modules, then forks each engine
(and the ipyparallel controller) on request, so a rank is ready in the time it
takes to register with the controller. Forking is safe here because the host
never touches CUDA or starts a thread pool before it forks.

Run as ``python -m labkit.cluster.hosted.process_host``; it speaks JSON lines on stdin/stdout:

    -> {"id": 1, "entry": "controller" | "engine", "argv": [...], "env": {...}, "log": path}
    <- {"id": 1, "pid": 4242}          or   {"id": 1, "error": "..."}
    <- {"event": "ready", ...}          once, after the heavy imports
    <- {"event": "exit", "pid": 4242, "code": 0}   whenever a child ends

Nothing is left behind: when the host's stdin closes (its owner stopped it, or
died), it terminates every child it forked and exits; every child also holds the
read end of a "life pipe" and terminates itself when the host is gone.

``ProcessHost`` below is the owner's side of that conversation.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

# Modules every rank needs; imported once in the host so forked engines share them.
RANK_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "ipyparallel.engine.app",
    "ipyparallel.engine.kernel",
    "ipykernel.ipkernel",
    "ipykernel.zmqshell",
    "ipykernel.debugger",  # pulls in debugpy, the slowest import of an engine
    "IPython.core.debugger",
    "pydoc",
    "labkit.rank.runtime",
)
CONTROLLER_MODULE = "ipyparallel.controller.app"
TERMINATE_GRACE_SECONDS = 3.0


# ---------------------------------------------------------------------------
# The host process
# ---------------------------------------------------------------------------


def _run_child(entry: str, argv: list[str], life_read_fd: int) -> None:
    """Body of a forked child: become the controller or an engine, never return."""
    code = 1
    try:
        _watch_host_life(life_read_fd)
        if entry == "controller":
            from ipyparallel.controller.app import main
        elif entry == "engine":
            from ipyparallel.engine.app import main
        else:
            raise ValueError(f"unknown entry {entry!r}")
        sys.argv = [f"labkit-{entry}", *argv]
        main(argv)
        code = 0
    except SystemExit as exit_request:
        code = exit_request.code if isinstance(exit_request.code, int) else 0
    except BaseException:  # report anything to the child's log, then exit
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _watch_host_life(life_read_fd: int) -> None:
    """Terminate this child when the host process goes away (its pipe end closes)."""

    def wait_for_host_exit() -> None:
        try:
            while os.read(life_read_fd, 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(TERMINATE_GRACE_SECONDS)
        os._exit(1)

    threading.Thread(target=wait_for_host_exit, name="labkit-host-watch", daemon=True).start()


class _Host:
    """The server loop of the host process."""

    def __init__(self) -> None:
        # The protocol gets private copies of stdin/stdout, so that anything an
        # imported module prints cannot corrupt it.
        self.requests_fd = os.dup(0)
        self.request_buffer = b""
        self.replies = os.fdopen(os.dup(1), "w", buffering=1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(2, 1)  # stray prints go to the host's log (its stderr)
        os.close(devnull)
        self.life_read_fd, self.life_write_fd = os.pipe()
        self.children: dict[int, str] = {}
        self.rank_modules_loaded = False

    def reply(self, message: dict) -> None:
        self.replies.write(json.dumps(message) + "\n")
        self.replies.flush()

    def load_rank_modules(self) -> None:
        if self.rank_modules_loaded:
            return
        for name in RANK_MODULES:
            __import__(name)
        import torch
        import torch.distributed as dist

        self.rank_modules_loaded = True
        self.reply(
            {
                "event": "ready",
                "torch": torch.__version__,
                "cuda_build": torch.version.cuda is not None,
                "nccl": bool(dist.is_nccl_available()),
                "gloo": bool(dist.is_gloo_available()),
            }
        )

    def spawn(self, request: dict) -> int:
        entry = request["entry"]
        if entry == "engine":
            self.load_rank_modules()
        # Children share the host's objects copy-on-write; frozen, the garbage
        # collector neither walks nor touches (and so copies) them.
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            self.children[pid] = entry
            return pid
        # --- in the child ---
        os.setsid()  # own session: a Ctrl-C meant for the notebook does not reach ranks
        for fd in (self.requests_fd, self.replies.fileno(), self.life_write_fd):
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        os.environ.update(request.get("env") or {})
        _run_child(entry, list(request.get("argv") or []), self.life_read_fd)
        raise AssertionError("unreachable")

    def reap(self) -> bool:
        """Collect every child that ended (forked or adopted); False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if self.children.pop(pid, None) is not None:
                self.reply({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def handle(self, line: str) -> None:
        request = json.loads(line)
        try:
            pid = self.spawn(request)
        except Exception as error:  # the owner decides what to do with it
            self.reply({"id": request.get("id"), "error": f"{type(error).__name__}: {error}"})
        else:
            self.reply({"id": request.get("id"), "pid": pid})

    def pending_request(self, timeout: float) -> str | None:
        """The next request line, '' at end of input, None if none came in time."""
        while b"\n" not in self.request_buffer:
            ready, _, _ = select.select([self.requests_fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.requests_fd, 65536)
            if not chunk:
                return ""
            self.request_buffer += chunk
        line, _, self.request_buffer = self.request_buffer.partition(b"\n")
        return line.decode() + "\n"

    def serve(self) -> None:
        __import__(CONTROLLER_MODULE)
        # A controller request sent right after start is served before the
        # slow rank imports, so the controller boots while torch loads.
        line = self.pending_request(0.05)
        while line:
            self.handle(line)
            line = self.pending_request(0)
        if line == "":
            return
        self.load_rank_modules()
        while True:
            self.reap()
            line = self.pending_request(0.1)
            if line is None:
                continue
            if line == "":
                return
            self.handle(line)

    def terminate_children(self) -> None:
        """SIGTERM every child (and what it started), then SIGKILL what is left; reap them all."""
        os.close(self.life_write_fd)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in list(self.children):
                _signal_group(pid, sig)
            deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
            while self.reap() and time.monotonic() < deadline:
                if not self.children:
                    # Direct children are gone; give their orphans (adopted by us) a moment.
                    deadline = min(deadline, time.monotonic() + 0.5)
                time.sleep(0.02)
            if not self.children:
                break


def _signal_group(pid: int, sig: int) -> None:
    """Signal a child and everything it started (each child leads its own group)."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except ProcessLookupError:
            continue
        except PermissionError:
            return


def _become_subreaper() -> None:
    """Adopt orphaned descendants (the controller's scheduler processes, say) and reap them.

    Without this, a grandchild whose parent exits first is handed to the machine's
    init, which may leave it a zombie for a while after the lab has stopped.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def main() -> None:
    _become_subreaper()
    host = _Host()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host.serve()
    except SystemExit:
        pass
    finally:
        host.terminate_children()


# ---------------------------------------------------------------------------
# The owner's side
# ---------------------------------------------------------------------------


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
        self._replies: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def start(self) -> "ProcessHost":
        env = dict(os.environ if self.env is None else self.env)
        with open(self.log_path, "ab") as log:
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


if __name__ == "__main__":
    main()
