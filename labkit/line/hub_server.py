"""The hub: the notebook's end of every line, a TLS websocket endpoint on one port, in a thread of its own.

``LineHub(...).start()`` listens on ``host:port`` (TLS always) at ``token.PATH``. A connection must
prove it holds the lab's secret (HMAC of a fresh nonce) within ``HANDSHAKE_SECONDS``, and the hub
proves it back; a new site must come with a token that has not expired, a site that lost its
websocket may resume its session for ``resume_seconds`` whatever the token's age. Each site has one
``LineSession``; the streams it opens are connected to the targets the hub allows (the controller's
ports, the outer sync's) and to nothing else.

The notebook reads the sites (``sites()``: a copy, safe from any thread) and sends them requests
(``tell``). Sites report their engines' processes (``SiteLink.engines``, ``exits``), which is how the
lab learns at once that a site's rank ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from labkit.line import token as tokens
from labkit.line.session import LineSession, abort
from labkit.line.tls import server_context
from labkit.spec.errors import LabConfigError

HANDSHAKE_SECONDS = 10.0
RESUME_SECONDS = 30.0
MAX_MESSAGE = 1024 * 1024  # a frame is at most 256 KiB of payload; anything larger is not ours
log = logging.getLogger("labkit.line")


@dataclass
class SiteLink:
    """What the hub knows of one site (a copy when read through ``LineHub.sites``)."""

    name: str
    session: str
    info: dict  # what the agent said of its machine: host, ranks, gpus, cores, versions
    joined_at: float
    connected: bool = True
    connections: int = 1  # websockets this session has had (reconnects + 1)
    engines: list[int] = field(default_factory=list)  # pids of the engines the agent runs now
    exits: dict[int, int] = field(default_factory=dict)  # pid -> exit code of engines that ended
    local_ports: list[int] = field(default_factory=list)  # the line's local ends on the site
    detached_for: float = 0.0
    bytes_out: dict[str, int] = field(default_factory=dict)  # hub -> site, by target
    bytes_in: dict[str, int] = field(default_factory=dict)
    gone: bool = False  # its session ended (it left, or did not come back within resume_seconds)


class LineHub:
    def __init__(self, host: str, port: int, secret: str, lab: str, certfile: str, keyfile: str,
                 targets: dict[str, tuple[str, int]], welcome: dict, resume_seconds: float = RESUME_SECONDS):
        self.host, self.port = host, port
        self.secret, self.lab = secret, lab
        self.context = server_context(certfile, keyfile)
        self.targets = dict(targets)  # stream target name -> (host, port) on this machine
        self.welcome = welcome  # what every site is told: the engines' connection info, the drop time
        self.resume_seconds = resume_seconds
        self.expires = 0.0  # new sites are admitted until then (join_command sets it)
        self.events: list[tuple[float, str]] = []
        self._links: dict[str, SiteLink] = {}
        self._sessions: dict[str, LineSession] = {}  # by site name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None  # websockets' Server
        self._expirer: asyncio.Task | None = None
        self._forwards: dict[tuple[str, int], asyncio.Server] = {}  # (site, its port) -> local listener
        self._guard = threading.Lock()

    # -- from the notebook's thread ------------------------------------------------

    def start(self, timeout: float = 10.0) -> LineHub:
        ready: asyncio.Future | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            nonlocal ready
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as error:  # noqa: BLE001 - told to the starting thread
                failure.append(error)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="labkit-line-hub", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or failure:
            error = failure[0] if failure else TimeoutError("no answer")
            raise LabConfigError(f"the lab's HTTPS line could not listen on {self.host}:{self.port}: {error}. "
                                 "Choose another port (lab.join_command(https=True, port=...)) or address") from None
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Tell every site the lab stops (their agents end their engines and exit), then close."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._say_goodbye(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._loop = self._thread = None

    def sites(self) -> dict[str, SiteLink]:
        now = time.monotonic()
        with self._guard:
            copies = {}
            for name, link in self._links.items():
                session = self._sessions.get(name)
                detached = session.detached_at if session is not None else None
                copies[name] = replace(link, engines=list(link.engines), exits=dict(link.exits),
                                       local_ports=list(link.local_ports),
                                       detached_for=0.0 if detached is None else now - detached,
                                       bytes_out=dict(session.bytes_out) if session else dict(link.bytes_out),
                                       bytes_in=dict(session.bytes_in) if session else dict(link.bytes_in))
            return copies

    def tell(self, site: str, message: dict, timeout: float = 5.0) -> bool:
        """Send a control message to ``site``; False when it has no session."""
        if self._loop is None:
            return False
        return asyncio.run_coroutine_threadsafe(self._tell(site, message), self._loop).result(timeout)

    def call(self, coroutine, timeout: float = 10.0):
        """Run ``coroutine`` on the hub's loop (from another thread); its result."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the lab's line is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def forward(self, site: str, port: int) -> int:
        """A port on this machine's loopback that reaches ``port`` on ``site``'s loopback through its line."""
        return self.call(self._forward(site, port))

    async def _forward(self, site: str, port: int) -> int:
        key = (site, port)
        if key not in self._forwards:
            async def through_line(reader, writer) -> None:
                session = self._sessions.get(site)
                if session is None or session.closed:
                    writer.close()
                    return
                await session.open_stream(f"loopback:{port}", reader, writer)

            self._forwards[key] = await asyncio.start_server(through_line, "127.0.0.1", 0)
        return self._forwards[key].sockets[0].getsockname()[1]

    def add_target(self, name: str, address: tuple[str, int]) -> None:
        """Let sites open streams to ``address`` under ``name`` (the outer sync's service, when it starts)."""
        self.targets[name] = address

    # -- on the hub's loop ------------------------------------------------------------

    async def _serve(self) -> None:
        from websockets.asyncio.server import serve

        self._server = await serve(self._handle, self.host, self.port, ssl=self.context, max_size=MAX_MESSAGE,
                                   ping_interval=None, compression=None)
        if self.port == 0:
            self.port = next(iter(self._server.sockets)).getsockname()[1]
        self._expirer = asyncio.get_running_loop().create_task(self._expire())

    async def _handle(self, websocket) -> None:
        if websocket.request.path != tokens.PATH:
            await websocket.close(1008, "not a labkit line")
            return
        try:
            session, received = await asyncio.wait_for(self._admit(websocket), HANDSHAKE_SECONDS)
        except (asyncio.TimeoutError, ValueError, KeyError, TypeError) as error:
            self._event(f"a connection from {websocket.remote_address[0]} was refused: "
                        f"{error or 'no answer to the handshake'}")
            abort(websocket)
            return
        except _Refused as error:
            self._event(f"a connection from {websocket.remote_address[0]} was refused: {error}")
            with contextlib.suppress(Exception):
                await websocket.send(json.dumps({"refused": str(error)}))
                await websocket.close(1008, "refused")
            return
        await session.attach(websocket, received)

    async def _admit(self, websocket) -> tuple[LineSession, int]:
        nonce = secrets.token_hex(16)
        await websocket.send(json.dumps({"line": "labkit", "version": 1, "nonce": nonce}))
        hello = json.loads(await websocket.recv())
        if hello.get("lab") != self.lab:
            raise _Refused("its token is for another lab (or an earlier run of this one): print a new join command")
        if not tokens.proof_holds(self.secret, nonce, "site", hello.get("proof")):
            raise _Refused("it could not prove it holds the lab's token")
        name = str(hello["site"])
        session = self._sessions.get(name)
        resumed = session is not None and not session.closed and hello.get("session") == session.label
        if resumed:
            assert session is not None
            with self._guard:
                link = self._links[name]
                link.connected, link.connections = True, link.connections + 1
            self._event(f"site {name} reconnected (connection {link.connections})")
        else:
            if time.time() > self.expires:
                raise _Refused("its join token has expired: print a new join command (lab.join_command(https=True))")
            if session is not None and not session.closed and session.websocket is not None:
                raise _Refused(f"a site named {name!r} is connected already: run the join command there with "
                               "--name and another name")
            if session is not None:
                await self._end(name, f"site {name} joined anew (its earlier line ended)")
            session = LineSession(secrets.token_hex(8), on_open=self._open, first_stream=2,
                                  on_control=functools.partial(self._from_site, name))
            with self._guard:
                self._sessions[name] = session
                self._links[name] = SiteLink(name, session.label, dict(hello.get("info", {})), time.time())
            self._event(f"site {name} joined from {websocket.remote_address[0]}")
        await websocket.send(json.dumps({"session": session.label, "resumed": resumed,
                                         "received": session.inbox.received,
                                         "proof": tokens.prove(self.secret, nonce, "hub"), **self.welcome}))
        return session, int(hello.get("received", 0)) if resumed else 0

    async def _open(self, session: LineSession, target: str):
        address = self.targets.get(target)
        if address is None:
            log.warning("line %s asked for %r, which is not a target", session.label, target)
            return None
        try:
            return await asyncio.open_connection(*address)
        except OSError:
            return None

    async def _from_site(self, name: str, message: dict) -> None:
        with self._guard:
            link = self._links.get(name)
            if link is None:
                return
            if message.get("op") == "engines":
                link.engines = [int(pid) for pid in message.get("pids", [])]
                link.exits.update({int(pid): int(code) for pid, code in message.get("exits", {}).items()})
                link.local_ports = [int(port) for port in message.get("ports", link.local_ports)]
        if message.get("op") == "leaving":
            await self._end(name, f"site {name} left ({message.get('why', 'its join command ended')})")

    async def _tell(self, site: str, message: dict) -> bool:
        session = self._sessions.get(site)
        if session is None or session.closed:
            return False
        await session.send_control(message)
        return True

    async def _expire(self) -> None:
        """Sessions whose site has not come back within resume_seconds end (their streams close)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for name, session in list(self._sessions.items()):
                with self._guard:
                    link = self._links.get(name)
                    if link is not None and session.websocket is None and link.connected:
                        link.connected = False
                if session.detached_at is not None and now - session.detached_at > self.resume_seconds \
                        and not session.closed:
                    await self._end(name, f"site {name} did not come back within {self.resume_seconds:g} s")

    async def _end(self, name: str, why: str) -> None:
        session = self._sessions.get(name)
        if session is not None:
            await session.close()
        with self._guard:
            link = self._links.get(name)
            if link is not None:
                link.gone, link.connected = True, False
                if session is not None:
                    link.bytes_out, link.bytes_in = dict(session.bytes_out), dict(session.bytes_in)
        self._event(why)

    async def _say_goodbye(self) -> None:
        for name, session in list(self._sessions.items()):
            if not session.closed and session.websocket is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(session.send_control({"op": "stop"}), 1.0)
        await asyncio.sleep(0.2)  # the frames leave before the sockets close

    async def _shutdown(self) -> None:
        if self._expirer is not None:
            self._expirer.cancel()
        for name in list(self._sessions):
            await self._end(name, f"site {name}: the lab stopped")
        for forward in self._forwards.values():
            forward.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def _event(self, text: str) -> None:
        log.info("line: %s", text)
        with self._guard:
            self.events.append((time.time(), text))


class _Refused(Exception):
    """A connection that may not join, with the reason the site is told."""
