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

Nothing is left behind, including what the ranks start themselves (a cell's
``subprocess.Popen``): every child leads its own process group, which its
subprocesses join; when a child ends, the host ends the rest of its group. A
process that left the group (``start_new_session=True``, ``setsid cmd &``) is
still found: every child carries a token of its own in its environment
(``LABKIT_OWNER``), which the programs it starts inherit; the host adopts every
orphan below it (a Linux child subreaper), so when a child ends, what it started
outside its group comes to the host, which ends each adopted process whose token
names no living child (with everything below it). When its stdin closes (its
owner stopped it, or died) the host terminates every process below it and
exits. Every child also holds the read end of a "life pipe" and, when the host
is gone, terminates its own process group.

``labkit.cluster.hosted.host_client.ProcessHost`` is the owner's side of that conversation.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: the host imports no labkit code until it is asked to warm
    from labkit.cluster.hosted.warmer import IdleWarmer

# Modules every rank needs; imported once in the host so forked engines share them.
RANK_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "ipyparallel.engine.app",
    "ipyparallel.engine.kernel",
    "ipykernel.ipkernel",
    "ipykernel.zmqshell",
    "ipykernel.debugger",  # pulls in debugpy, the slowest import of an engine (optional, below)
    "IPython.core.debugger",
    "pydoc",
    "labkit.rank.runtime",  # wire.entry.RANK_RUNTIME_MODULE (this module imports no labkit code)
)
# What a rank imports on its first training run or checkpoint (about 1.5 s of CPU). The host
# imports them once the lab is ready ("warm" request), while the ranks are idle (warmer.py), so
# ranks forked later (replacing one that died) start with them: a heal does not pay them again.
WARM_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "labkit.rank.loop",
    "labkit.rank.checkpoint",
    "labkit.rank.verify",
)
# Imported ahead only to save ranks time: a machine without them (no debugpy) still starts its ranks.
OPTIONAL_MODULES = frozenset({"ipykernel.debugger"})
CONTROLLER_MODULE = "ipyparallel.controller.app"
TERMINATE_GRACE_SECONDS = 3.0
# The environment variable by which a process started below a child names that child.
OWNER_VARIABLE = "LABKIT_OWNER"


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
        with contextlib.suppress(OSError):
            while os.read(life_read_fd, 1):
                pass
        group = os.getpgrp()  # this child's own group: it and what it started
        os.killpg(group, signal.SIGTERM)
        time.sleep(TERMINATE_GRACE_SECONDS)
        os.killpg(group, signal.SIGKILL)

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
        self.tokens: dict[int, str] = {}  # child pid -> the token its descendants carry (OWNER_VARIABLE)
        self.spawned = 0
        self.rank_modules_loaded = False
        self.warmer: IdleWarmer | None = None  # once the owner asks for the warm imports
        self.warm_requests: list = []  # ids of warm requests, answered once every module is imported

    def reply(self, message: dict) -> None:
        self.replies.write(json.dumps(message) + "\n")
        self.replies.flush()

    def load_rank_modules(self) -> None:
        if self.rank_modules_loaded:
            return
        skipped = {}
        for name in RANK_MODULES:
            try:
                __import__(name)
            except ImportError as error:
                if name not in OPTIONAL_MODULES:
                    raise
                skipped[name] = f"{type(error).__name__}: {error}"  # ranks import it themselves, if they can
                print(f"labkit process host: {name} not imported ahead ({skipped[name]})", file=sys.stderr, flush=True)
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
                "skipped": skipped,
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
        self.spawned += 1
        # Unique over the host's life (a pid can be reused, a token is not).
        token = f"{os.getpid()}-{self.spawned}"
        pid = os.fork()
        if pid:
            self.children[pid] = entry
            self.tokens[pid] = token
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
        os.environ[OWNER_VARIABLE] = token  # inherited by every program it starts
        _run_child(entry, list(request.get("argv") or []), self.life_read_fd)
        raise AssertionError("unreachable")

    def reap(self, sweep: bool = False) -> bool:
        """Collect every child that ended (forked or adopted); False once none is left.

        ``sweep``: when something ended, also end what ended children started outside their group."""
        ended = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                if ended and sweep:
                    self.sweep_orphans()
                return True
            ended = True
            if self.children.pop(pid, None) is not None:
                self.tokens.pop(pid, None)
                # What the child started dies with it (now, before its pid can be reused).
                _signal_group(pid, signal.SIGKILL, leader=False)
                self.reply({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def sweep_orphans(self) -> None:
        """End every adopted process (and what is below it) whose token names no living child.

        When a child ends, what it started in a session or group of its own is reparented to the
        host (a subreaper). A process adopted while its child still lives (a shell's ``cmd &``)
        carries that child's token and stays; one without a token cannot be told apart and is
        left to ``terminate_children``. Ending an orphan reparents its own children here, and its
        end brings the host back here for them."""
        import psutil

        living = set(self.tokens.values())
        ours = f"{os.getpid()}-"  # a token of another host (a lab started inside a rank) is not ours to judge
        try:
            adopted = [child for child in psutil.Process().children() if child.pid not in self.children]
        except psutil.Error:
            return
        for orphan in adopted:
            try:
                token = orphan.environ().get(OWNER_VARIABLE)
                if token is None or not token.startswith(ours) or token in living:
                    continue
                family = [orphan, *orphan.children(recursive=True)]
            except psutil.Error:
                continue  # ended meanwhile, or not ours to read
            for process in family:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signal.SIGKILL)

    def handle(self, line: str) -> None:
        request = json.loads(line)
        if request.get("entry") == "warm":
            if self.warmer is None:
                from labkit.cluster.hosted.warmer import IdleWarmer

                self.warmer = IdleWarmer(WARM_MODULES)
            self.warmer.request()  # imported while the ranks are idle (serve), not now
            self.warm_requests.append(request.get("id"))
            self.answer_warm_requests()
            return
        try:
            pid = self.spawn(request)
        except Exception as error:  # the owner decides what to do with it
            self.reply({"id": request.get("id"), "error": f"{type(error).__name__}: {error}"})
        else:
            self.reply({"id": request.get("id"), "pid": pid})

    def answer_warm_requests(self) -> None:
        if self.warmer is not None and self.warmer.done:
            for request_id in self.warm_requests:
                self.reply({"id": request_id, "warm": True})
            self.warm_requests.clear()

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
            self.reap(sweep=True)
            line = self.pending_request(0.1)
            if line is None:
                if self.warmer is not None and self.warmer.tick(
                        [pid for pid, entry in self.children.items() if entry == "engine"]):
                    self.answer_warm_requests()
                continue
            if line == "":
                return
            self.handle(line)

    def terminate_children(self) -> None:
        """SIGTERM every process below the host, then SIGKILL what is left; reap them all."""
        os.close(self.life_write_fd)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in list(self.children):
                _signal_group(pid, sig)
            _signal_descendants(sig)  # adopted orphans, and anything that left its group
            deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
            while self.reap() and time.monotonic() < deadline:
                if not self.children:
                    # Direct children are gone; give their orphans (adopted by us) a moment.
                    deadline = min(deadline, time.monotonic() + 0.5)
                time.sleep(0.02)
            if not self.children and not _descendants():
                break


def _signal_group(pid: int, sig: int, leader: bool = True) -> None:
    """Signal a child and everything it started (each child leads its own group)."""
    for send in (os.killpg, os.kill) if leader else (os.killpg,):
        try:
            send(pid, sig)
            return
        except ProcessLookupError:
            continue
        except PermissionError:
            return


def _descendants() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _signal_descendants(sig: int) -> None:
    import psutil

    for process in _descendants():
        with contextlib.suppress(psutil.Error):
            process.send_signal(sig)


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
    os.umask(0o077)  # logs, connection files and sockets of the lab: its owner's only
    host = _Host()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with contextlib.suppress(SystemExit):
            host.serve()
    finally:
        host.terminate_children()


if __name__ == "__main__":
    main()
