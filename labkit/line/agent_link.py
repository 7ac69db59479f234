"""The joining machine's end of a line: connect out, prove the token, resume or begin a session, reconnect.

``LineClient.run()`` dials the token's ``wss://`` address (through ``HTTPS_PROXY``'s HTTP CONNECT
proxy when one is set: websockets reads the proxy variables itself), checks the hub's certificate
(the token's pin, or the usual chain and name checks), proves the token with an HMAC of the hub's
nonce and checks the hub's proof, then attaches the session's websocket until it drops, and dials
again with growing pauses (``BACKOFF``), for ``GIVE_UP_SECONDS`` at most. A session the hub still holds is resumed (nothing lost);
otherwise the hub begins a new one and ``on_session`` is told. A refusal (another lab, an expired
token, a name in use) ends ``run`` with ``LineRefused``: dialling again would not help.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Awaitable, Callable

from labkit.line import token as tokens
from labkit.line.hub_server import MAX_MESSAGE
from labkit.line.session import LineSession
from labkit.line.tls import check_pin, client_context

BACKOFF = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
GIVE_UP_SECONDS = 300.0  # a hub unreachable this long is taken for gone: the site leaves, nothing lingers
# Refused (nothing listens at the hub's address, or the proxy says the hub refused) for longer than the hub
# keeps a site's session waiting: the lab has stopped, and a lab started anew does not take this token.
REFUSED_SECONDS = 35.0
OPEN_SECONDS = 15.0
log = logging.getLogger("labkit.line")


class LineRefused(RuntimeError):
    """The hub will not take this site (the reason is the hub's own words)."""


class LineClient:
    def __init__(self, token: tokens.LineToken, site: str, info: dict, cafile: str | None = None,
                 on_session: Callable[[LineSession, dict], Awaitable[None]] | None = None,
                 on_control: Callable[[dict], Awaitable[None]] | None = None,
                 on_open=None, say: Callable[[str], None] = print) -> None:
        self.token, self.site, self.info = token, site, info
        self.context: ssl.SSLContext = client_context(token.pin, cafile)
        self.on_session, self.on_control, self.on_open = on_session, on_control, on_open
        self.say = say
        self.session: LineSession | None = None
        self.welcome: dict = {}
        self.connections = 0
        self.stopped = False
        self.give_up_seconds = GIVE_UP_SECONDS

    async def run(self) -> None:
        failures = 0
        reached = time.monotonic()  # when the hub last answered (or this began)
        refused_since: float | None = None  # since when every dial was refused
        while not self.stopped:
            try:
                websocket, received = await self._connect()
            except LineRefused:
                raise
            except Exception as error:  # noqa: BLE001 - unreachable, reset, proxy refused: dial again
                refused_since = refused_since or time.monotonic() if _refused(error) else None
                if refused_since is not None and time.monotonic() - refused_since > REFUSED_SECONDS:
                    raise LineRefused(f"nothing has answered at {self.token.url} for {REFUSED_SECONDS:g} s (the "
                                      "connection is refused): the lab has stopped") from None
                if time.monotonic() - reached > self.give_up_seconds:
                    raise LineRefused(f"the lab's hub has not answered for {self.give_up_seconds:g} s "
                                      f"({describe(error)}): the lab has stopped, or this machine lost its way out")
                pause = BACKOFF[min(failures, len(BACKOFF) - 1)]
                if failures in (0, 3) or failures % 10 == 9:
                    self.say(f"labkit: cannot reach the lab's line at {self.token.url} ({describe(error)}); "
                             f"trying again every few seconds")
                failures += 1
                await asyncio.sleep(pause)
                continue
            failures, refused_since = 0, None
            assert self.session is not None
            await self.session.attach(websocket, received)
            reached = time.monotonic()
            if not self.stopped and not self.session.closed:
                self.say("labkit: the line dropped; reconnecting")

    async def _connect(self):
        from websockets.asyncio.client import connect

        websocket = await connect(self.token.url, ssl=self.context, open_timeout=OPEN_SECONDS, max_size=MAX_MESSAGE,
                                  ping_interval=None, compression=None, user_agent_header="labkit-line")
        try:
            check_pin(websocket.transport.get_extra_info("ssl_object"), self.token.pin)
            hello = json.loads(await asyncio.wait_for(websocket.recv(), OPEN_SECONDS))
            nonce = hello["nonce"]
            current = self.session if self.session is not None and not self.session.closed else None
            await websocket.send(json.dumps({
                "lab": self.token.lab, "proof": self.token.proof(nonce, "site"), "site": self.site,
                "session": current.label if current else None,
                "received": current.inbox.received if current else 0, "info": self.info}))
            welcome = json.loads(await asyncio.wait_for(websocket.recv(), OPEN_SECONDS))
        except BaseException:
            await websocket.close()
            raise
        if "refused" in welcome:
            await websocket.close()
            raise LineRefused(welcome["refused"])
        if not tokens.proof_holds(self.token.secret, nonce, "hub", welcome.get("proof")):
            await websocket.close()
            raise LineRefused("the hub could not prove it holds the lab's token: this is not the lab's hub")
        self.connections += 1
        self.welcome = welcome
        if current is not None and welcome["session"] == current.label:
            return websocket, int(welcome["received"])
        if current is not None:
            await current.close()  # the hub forgot it: its streams are gone on that side too
        self.session = LineSession(welcome["session"], on_control=self.on_control, on_open=self.on_open)
        if self.on_session is not None:
            await self.on_session(self.session, welcome)
        return websocket, 0

    async def stop(self) -> None:
        self.stopped = True
        if self.session is not None:
            await self.session.close()


def _refused(error: BaseException) -> bool:
    """The hub's machine answered that nothing listens there (directly, or through the proxy)."""
    if isinstance(error, ConnectionRefusedError):
        return True
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status in (502, 503)  # a proxy's "bad gateway": it could not connect to the hub


def describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 200 else text[:200] + "..."
