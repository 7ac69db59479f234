"""A site: a machine behind NAT that joined a lab over one outbound HTTPS line, and the agent that runs it.

``python -m labkit join <https token> [--ranks N] [--name NAME]`` runs ``run_site``. The agent opens
the line (``line.agent_link.LineClient``), makes one local end (a loopback listener) for each
controller port the hub names, and starts ``ranks`` stock ipyparallel engines (with their nanny)
whose connection info points at those local ends (``line.targets.local_connection``). The engines
become the site's ranks in the notebook (``cluster.site_cluster``); they form a torch.distributed
group of their own, on this machine's loopback: nothing of torch.distributed crosses the line.

Nothing here listens on a network interface: the local ends, like the ranks' own group, are on
127.0.0.1 only, and the line is a connection *out*. The agent keeps ``ranks`` engines running: one
that ends is reported to the hub at once (the lab names it) and started again (that is how the lab
replaces a site's rank, one that died or one its controller dropped while the line was down: it asks
the agent to kill it), unless it keeps failing at its start; new engines start only while the line
is up (they could not register otherwise). The hub may open a stream back only to a loopback port
that this site's own ranks listen on (their rendezvous store). The agent ends, and its engines with
it, when the lab stops, on Ctrl-C, when the hub refuses the token, or after ``GIVE_UP_SECONDS``
without reaching the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from labkit.cluster.join import engine_command
from labkit.line import token as tokens
from labkit.line.agent_link import LineClient, LineRefused
from labkit.line.session import LineSession
from labkit.line.targets import LOOPBACK, SYNC, local_connection
from labkit.spec.errors import LabConfigError
from labkit.wire.gpus import visible_gpus

SITE_SLOT_PREFIX = "site:"  # LABKIT_SLOT of a site's engine: "site:<name>"
SYNC_VARIABLE = "LABKIT_SITE_SYNC"  # host:port of the outer sync's local end, for the site's ranks
SUPERVISE_SECONDS = 0.2
FAST_FAILURE_SECONDS = 20.0  # an engine that ends sooner than this after its start failed to start
FAST_FAILURES = 3  # ... this many times in a row: it is not started again (its log is shown)
STOP_SECONDS = 3.0
MAX_RANKS = 1024
SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def site_info(ranks: int) -> dict:
    """What the hub and the notebook are told of this machine when it joins."""
    try:
        version = metadata.version("labkit")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"host": socket.gethostname(), "ranks": ranks, "cores": os.cpu_count() or 1,
            "gpus": list(visible_gpus()), "python": sys.version.split()[0], "labkit": version}


class SiteAgent:
    def __init__(self, token: tokens.LineToken, name: str, ranks: int, cafile: str | None = None, say=print):
        self.name, self.ranks, self.say = name, ranks, say
        self.folder = tempfile.mkdtemp(prefix="labkit-site-")  # private (0700), removed at the end
        self.client = LineClient(token, name, site_info(ranks), cafile, on_session=self._on_session,
                                 on_control=self._on_control, on_open=self._open_local, say=say)
        self.local_ports: dict[str, int] = {}  # target -> the port of its local end here
        self._servers: list[asyncio.AbstractServer] = []
        self.engines: dict[int, subprocess.Popen] = {}  # local rank -> its engine's process
        self.started_at: dict[int, float] = {}
        self.fast_failures: dict[int, int] = {}
        self.exits: dict[int, int] = {}  # pid -> exit code, reported to the hub
        self.children: dict[int, list] = {}  # engine pid -> the processes it started (psutil), to end with it
        self.connection: dict | None = None
        self.stale_seconds = 1.5
        self.done = asyncio.Event()
        self.exit_code = 0
        self._reported: object = None

    # -- the line ------------------------------------------------------------------

    async def _on_session(self, session: LineSession, welcome: dict) -> None:
        """A new session: local ends for the targets it names (kept across sessions), then the engines."""
        self.connection = welcome["connection"]
        self.stale_seconds = float(welcome.get("stale_seconds", self.stale_seconds))
        for target in welcome["targets"]:
            if target not in self.local_ports:
                server = await asyncio.start_server(functools.partial(self._accepted, target), LOOPBACK, 0)
                self._servers.append(server)
                self.local_ports[target] = server.sockets[0].getsockname()[1]
        if self.engines:
            self._end_engines("the lab's hub began a new line for this site")
        self._reported = None

    async def _accepted(self, target: str, reader, writer) -> None:
        session = self.client.session
        if session is None or session.closed:
            writer.close()
            return
        await session.open_stream(target, reader, writer)

    async def _open_local(self, session: LineSession, target: str):
        """The hub asks for a port on this loopback: only one that this site's own ranks listen on."""
        kind, _, port = target.partition(":")
        if kind != "loopback" or not port.isdigit() or int(port) not in self._ranks_ports():
            return None
        try:
            return await asyncio.open_connection(LOOPBACK, int(port))
        except OSError:
            return None

    def _ranks_ports(self) -> set[int]:
        """Ports this site's engines (and their children) listen on, on loopback."""
        import psutil

        ports = set()
        for process in self.engines.values():
            try:
                family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for member in family:
                with _gone():
                    ports |= {connection.laddr.port for connection in member.net_connections(kind="tcp")
                              if connection.status == psutil.CONN_LISTEN}
        return ports

    async def _on_control(self, message: dict) -> None:
        operation = message.get("op")
        if operation == "stop":
            self.say("labkit: the lab stopped; this site leaves")
            self.done.set()
        elif operation == "kill":
            for process in self.engines.values():
                if process.pid in message.get("pids", []):
                    _kill_group(process, signal.SIGKILL)
        elif operation == "signal":
            for process in self.engines.values():
                if process.pid in message.get("pids", []):
                    with _gone():
                        os.kill(process.pid, int(message["signum"]))

    # -- the engines ------------------------------------------------------------------

    def _start_engine(self, local_rank: int) -> None:
        assert self.connection is not None
        env = dict(os.environ, IPP_CONNECTION_INFO=json.dumps(local_connection(self.connection, self.local_ports)),
                   LABKIT_SLOT=f"{SITE_SLOT_PREFIX}{self.name}@{self.client.session.label}",  # type: ignore[union-attr]
                   LABKIT_SITE_RANK=str(local_rank))
        if SYNC in self.local_ports:
            env[SYNC_VARIABLE] = f"{LOOPBACK}:{self.local_ports[SYNC]}"
        profile = os.path.join(self.folder, f"engine{local_rank}")
        os.makedirs(profile, exist_ok=True)
        log = open(os.path.join(self.folder, f"engine{local_rank}.log"), "ab")
        try:
            self.engines[local_rank] = subprocess.Popen(engine_command(profile), env=env, stdout=log,
                                                        stderr=subprocess.STDOUT, preexec_fn=_own_group_ending_with_us)
        finally:
            log.close()
        self.started_at[local_rank] = time.monotonic()

    def _end_engines(self, why: str) -> None:
        if self.engines:
            self.say(f"labkit: ending this site's engines: {why}")
        for process in self.engines.values():
            _kill_group(process, signal.SIGKILL)
        for process in self.engines.values():
            with _gone():
                process.wait(STOP_SECONDS)
            _kill_group(process, signal.SIGKILL)
            _kill_known(self.children.pop(process.pid, []))  # its nanny, in a session of its own
            self.exits[process.pid] = process.returncode if process.returncode is not None else -9
        self.engines.clear()

    def _note_children(self, process: subprocess.Popen) -> None:
        """Remember what the engine started (its nanny), to end it with the engine."""
        import psutil

        if len(self.children.get(process.pid, [])) >= 1:
            return
        with contextlib.suppress(psutil.Error):
            self.children[process.pid] = psutil.Process(process.pid).children(recursive=True)

    def _silent(self) -> bool:
        session = self.client.session
        return session is None or time.monotonic() - session.last_heard > self.stale_seconds

    async def _supervise(self) -> None:
        while not self.done.is_set():
            if self.connection is not None:
                if not self._silent():  # an engine started while the line is down could not register
                    self._keep_engines()
                await self._report()
            await asyncio.sleep(SUPERVISE_SECONDS)

    def _keep_engines(self) -> None:
        for local_rank in range(self.ranks):
            process = self.engines.get(local_rank)
            if process is not None and process.poll() is None:
                self._note_children(process)
                continue
            if process is not None:
                code = process.returncode
                _kill_group(process, signal.SIGKILL)  # what is left of it
                _kill_known(self.children.pop(process.pid, []))  # its nanny
                self.exits[process.pid] = code
                quick = time.monotonic() - self.started_at[local_rank] < FAST_FAILURE_SECONDS
                self.fast_failures[local_rank] = self.fast_failures.get(local_rank, 0) + 1 if quick else 0
                self.say(f"labkit: the engine of local rank {local_rank} (pid {process.pid}) ended (exit code "
                         f"{code}); starting another")
                del self.engines[local_rank]
            if self.fast_failures.get(local_rank, 0) >= FAST_FAILURES:
                if self.fast_failures[local_rank] == FAST_FAILURES:
                    self.fast_failures[local_rank] += 1
                    self.say(f"labkit: local rank {local_rank}'s engine failed {FAST_FAILURES} times at its start; "
                             f"not starting it again. Its log:\n{_tail(self.folder, local_rank)}")
                continue
            self._start_engine(local_rank)

    async def _report(self) -> None:
        """Tell the hub which engines run here and how the ended ones ended, when that changed."""
        session = self.client.session
        state = ({rank: process.pid for rank, process in self.engines.items()}, dict(self.exits))
        if session is None or session.closed or state == self._reported:
            return
        self._reported = state
        await session.send_control({"op": "engines", "pids": sorted(state[0].values()), "exits": state[1],
                                    "ports": sorted(self.local_ports.values())})

    # -- the whole run ------------------------------------------------------------------

    async def run(self) -> int:
        line = asyncio.get_running_loop().create_task(self.client.run())
        supervisor = asyncio.get_running_loop().create_task(self._supervise())
        ended = asyncio.get_running_loop().create_task(self.done.wait())
        try:
            await asyncio.wait({line, ended}, return_when=asyncio.FIRST_COMPLETED)
            if line.done() and isinstance(line.exception(), LineRefused):
                self.say(f"labkit: the lab refused this site: {line.exception()}")
                self.exit_code = 2
        finally:
            self.done.set()
            self.client.stopped = True  # no more dialling: this site is leaving
            # Its engines' sockets close under streams still being written: asyncio's notes of that say nothing.
            logging.getLogger("asyncio").setLevel(logging.ERROR)
            supervisor.cancel()
            self._end_engines("this site leaves the lab")
            session = self.client.session
            if session is not None and not session.closed and session.websocket is not None:
                with _gone():
                    await asyncio.wait_for(session.send_control({"op": "leaving", "why": "its join command ended"}),
                                           1.0)
                    await asyncio.sleep(0.2)
            await self.client.stop()
            line.cancel()
            for server in self._servers:
                server.close()
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.exit_code


class _gone:
    """Ignore that a process or connection is already gone (or never answered)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, ChildProcessError, OSError,
                                                      subprocess.TimeoutExpired, asyncio.TimeoutError, RuntimeError))


def _kill_group(process: subprocess.Popen, signum: int) -> None:
    """The engine and whatever it started in its process group (also after it ended: a group's id is not
    given to another process while any member is left, so this reaches nothing else)."""
    with _gone():
        os.killpg(process.pid, signum)


def _kill_known(processes) -> None:
    """Processes seen as an engine's children (ipyparallel starts its nanny in a session of its own, and a
    nanny whose engine is gone may hang at its exit on messages it cannot deliver): SIGKILL, if still them."""
    import psutil

    for child in processes:
        with _gone():
            if child.is_running():  # the same process (psutil compares its start time), not a reused pid
                child.kill()
        with contextlib.suppress(psutil.Error):
            child.wait(STOP_SECONDS)


def _own_group_ending_with_us() -> None:
    """In the engine before it runs: a process group of its own (so its nanny is ended with it), and
    SIGTERM from the kernel when the agent dies, however it dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _tail(folder: str, local_rank: int, lines: int = 15) -> str:
    try:
        with open(os.path.join(folder, f"engine{local_rank}.log"), errors="replace") as handle:
            return "\n".join(handle.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_site(text: str, ranks: int | None = None, name: str | None = None, cafile: str | None = None) -> int:
    """The join command for an HTTPS token: run this machine as a site of the lab until the lab stops."""
    token = tokens.decode(text)
    if ranks is not None and not 1 <= ranks <= MAX_RANKS:
        raise LabConfigError(f"--ranks is how many ranks this site runs, 1 to {MAX_RANKS}; got {ranks}")
    count = ranks if ranks is not None else max(1, len(visible_gpus()))
    site = name or socket.gethostname().split(".")[0]
    if not SITE_NAME.fullmatch(site):
        raise LabConfigError(f"a site's name is 1 to 63 letters, digits, '-', '_' or '.', starting with a letter or "
                             f"digit; got {site!r}: give one with --name")
    if cafile is not None and not os.path.isfile(cafile):
        raise LabConfigError(f"--cafile {cafile}: no such file (a PEM bundle of the CA that signed the lab's "
                             "certificate)")
    if token.expired:
        raise LabConfigError("this join command has expired: print a new one in the lab "
                             "(lab.join_command(https=True), %lab join-command --https)")
    print(f"labkit: joining the lab at {token.url} as site {site!r} with {count} rank(s), over one outbound HTTPS "
          "connection. Ctrl-C leaves.", flush=True)
    agent = SiteAgent(token, site, count, cafile)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, agent.done.set)
        return await agent.run()

    code = asyncio.run(main())
    print(f"labkit: site {site!r} left the lab", flush=True)
    return code
