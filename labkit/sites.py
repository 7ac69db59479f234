"""A lab's sites: machines behind NAT that joined over its HTTPS line, each with ranks of its own.

``Sites`` belongs to a lab's ``Session``. ``open_line`` starts the lab's hub
(``cluster.line_endpoint``) the first time a join command for HTTPS is asked for, and it ends with
the ranks (``Session.on_stop``). For each site it keeps a ``Session`` whose cluster is the site's
engines (``cluster.site_cluster.SiteCluster``), formed into a group of the site's own when first used.

``LabSites`` is the part of ``Lab`` that speaks of them: ``join_command(https=True)``, ``sites``
(a table), ``site(name)`` (a ``Lab`` over that site's ranks: cells, ``run``, ``push``, ``train``,
meshes, all as on the lab itself) and ``wait_for_sites``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit.cluster.line_endpoint import ANY_ADDRESS, DEFAULT_EXPIRY, DEFAULT_PORT, LineEndpoint, open_line
from labkit.cluster.placement import plan_ranks
from labkit.cluster.site_cluster import SITE_LAUNCHER, SiteCluster, registered_engines
from labkit.session import Session
from labkit.spec.errors import LabConfigError
from labkit.units import parse_seconds, positive_seconds

if TYPE_CHECKING:
    from labkit.line.hub_server import SiteLink

POLL_SECONDS = 0.1


class Sites:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.endpoint: LineEndpoint | None = None
        self._listen: tuple[str, int] | None = None
        self.sessions: dict[str, Session] = {}
        self._joined: dict[str, str] = {}  # site -> the line session its ranks came over

    def open_line(self, address: str | None, port: int | None, url: str | None, certfile: str | None,
                  keyfile: str | None) -> LineEndpoint:
        cluster = self.session.require_running()
        if self.endpoint is not None and self._listen is not None:
            asked = (address or self._listen[0], port if port is not None else self._listen[1])
            if asked != self._listen or url is not None or certfile is not None:
                raise LabConfigError(f"the lab's line is open already on {self._listen[0]}:{self.endpoint.hub.port}"
                                     " (at " + self.endpoint.url + "): it stays as it is until the lab stops")
            return self.endpoint
        listen = (address or ANY_ADDRESS, DEFAULT_PORT if port is None else port)
        self.endpoint = open_line(cluster, *listen, url=url, certfile=certfile, keyfile=keyfile)
        self._listen = listen
        self.session.on_stop.append(self.close)
        return self.endpoint

    def links(self) -> dict[str, SiteLink]:
        return self.endpoint.hub.sites() if self.endpoint is not None else {}

    def names(self) -> list[str]:
        """The sites whose line is up now, by name (one down for a moment is not among them)."""
        return sorted(name for name, link in self.links().items() if not link.gone and link.connected)

    def site_session(self, name: str) -> Session:
        """The session of ``name``'s ranks, formed when first asked for (or when the site joined anew)."""
        link = self.links().get(name)
        if link is None or link.gone:
            known = ", ".join(self.names()) or "none yet"
            raise LabConfigError(f"no site named {name!r} is in the lab (sites: {known}); run the join command "
                                 "from lab.join_command(https=True) there")
        session = self.sessions.get(name)
        if session is not None and self._joined.get(name) != link.session:
            session.stop()  # the site joined anew: its ranks of before are gone
            session = None
        if session is None:
            session = self._new_session(name, link)
            self.sessions[name] = session
            self._joined[name] = link.session
        if not session.running:
            session.start()
        return session

    def _new_session(self, name: str, link: SiteLink) -> Session:
        parent = self.session.require_running()
        assert self.endpoint is not None
        ranks = int(link.info.get("ranks", 1))
        gpus = tuple(str(gpu) for gpu in link.info.get("gpus", []))
        plan = plan_ranks(ranks, backend="nccl" if len(gpus) >= ranks else "gloo", gpus=gpus,
                          threads_per_rank=max(1, int(link.info.get("cores", 1)) // ranks), on_this_machine=False)
        endpoint, limits = self.endpoint, self.session
        session = Session(plan, timeout=limits.timeout, start_timeout=limits.start_timeout,
                          interrupt_grace=limits.interrupt_grace, launcher=SITE_LAUNCHER,
                          make_cluster=lambda: SiteCluster(parent, endpoint, name, plan, limits.start_timeout))
        return session

    def wait(self, count: int, timeout: float, names: list[str] | None = None) -> list[str]:
        """Until ``count`` sites (or those ``names``) have joined with every engine they announced registered with
        the lab's controller; the names of those ready."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise LabConfigError(f"count is how many sites to wait for (1 or more), got {count!r}")
        wanted = set(names or ())
        if self.endpoint is None:
            raise LabConfigError("the lab has no HTTPS line yet: print its join command first "
                                 "(lab.join_command(https=True), %lab join-command --https)")
        deadline = time.monotonic() + positive_seconds("timeout", timeout)
        while True:
            parent = self.session.require_running()
            ready = [name for name, link in self.links().items() if not link.gone and link.connected
                     and (not wanted or name in wanted)
                     and len(registered_engines(parent, name, link.session)) >= int(link.info.get("ranks", 1))]
            if len(ready) >= max(count, len(wanted)):
                return sorted(ready)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ready)} of {count} site(s) joined within {timeout:g} s: run the join "
                                   f"command on each; the lab's line: {self.endpoint.url}")
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        for session in self.sessions.values():
            session.stop()
        self.sessions.clear()
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            endpoint.close()


@dataclass
class SitesTable:
    """Every site of a lab, one line each (what ``lab.sites`` shows)."""

    links: dict
    url: str | None

    def __repr__(self) -> str:
        if self.url is None:
            return "no HTTPS line: lab.join_command(https=True) opens it and prints the line that joins a machine"
        lines = [f"the lab's line: {self.url}"]
        for name, link in sorted(self.links.items()):
            state = ("gone" if link.gone else "connected" if link.connected
                     else f"line down for {link.detached_for:.1f} s")
            moved = sum(link.bytes_out.values()) + sum(link.bytes_in.values())
            lines.append(f"  {name}: {link.info.get('host', '?')}, {len(link.engines)}/{link.info.get('ranks', '?')} "
                         f"engines, {state}, {link.connections} connection(s), {moved / 1e6:.1f} MB through the line")
        if len(lines) == 1:
            lines.append("  no site has joined yet")
        return "\n".join(lines)

    def __iter__(self):
        return iter(sorted(name for name, link in self.links.items() if not link.gone))


class LabSites:
    """``Lab``'s methods for machines that join: its own join command, and sites over HTTPS."""

    session: Session
    _sites: Sites | None

    def join_command(self, python: str = "python", https: bool = False, address: str | None = None,
                     port: int | None = None, url: str | None = None, certfile: str | None = None,
                     keyfile: str | None = None, expires="1h", ranks: int | None = None) -> str:
        """The one command that, run on another machine with labkit installed, joins it to this lab.

        Without ``https``: an engine there becomes this lab's next rank at the next ``start()`` or ``heal()``
        (the lab's controller must be reachable: ``controller_address``; gloo and nccl need every host to
        reach every other). With ``https=True``: the machine becomes a *site* over one outbound TLS
        connection to this machine's ``address:port`` (default every interface, port 8443; ``url``: the
        address sites dial, when it differs), which works behind NAT and firewalls and through
        ``HTTPS_PROXY``. A site runs ``ranks`` ranks of its own (default: one per GPU there, else one);
        ``lab.site(name)`` uses them. ``certfile``/``keyfile``: a certificate of your own (else the lab makes
        one and the command pins it). New sites are admitted for ``expires`` (default one hour).
        Whoever holds the command can run code in the lab: share it like a password."""
        if not https:
            from labkit.cluster.join import join_command

            return join_command(self.session.require_running(), python)
        if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1024):
            raise LabConfigError(f"ranks is how many ranks the site runs (1 to 1024), got {ranks!r}")
        try:
            seconds = parse_seconds("expires", expires)
        except ValueError as error:
            raise LabConfigError(str(error)) from None  # one line in the notebook, not the lab's frames
        endpoint = self._registry().open_line(address, port, url, certfile, keyfile)
        return endpoint.join_command(seconds, python, ranks)

    @property
    def sites(self) -> SitesTable:
        """The sites that joined over the lab's HTTPS line: their machine, engines and line."""
        registry = self._registry()
        return SitesTable(registry.links(), registry.endpoint.url if registry.endpoint else None)

    def site(self, name: str):
        """A ``Lab`` over the ranks of site ``name``: ``lab.site("home").run_cell("print(rank)")``,
        ``.train("ddp", ...)``, ``.mesh(...)``. Its ranks form a group of their own on that machine."""
        view = type(self).__new__(type(self))
        view.session = self._registry().site_session(name)
        view._sites = None
        return view

    def site_sessions(self, sites) -> dict[str, Session]:
        """The sessions of ``sites`` ("all", a name, or names; None: none), formed if they were not."""
        if sites is None:
            return {}
        registry = self._registry()
        names = registry.names() if sites == "all" else [sites] if isinstance(sites, str) else list(sites)
        if sites == "all" and not names:
            raise LabConfigError("sites='all', but no site has joined: run lab.join_command(https=True)'s line "
                                 "on a machine first (lab.wait_for_sites() waits for it)")
        return {name: registry.site_session(name) for name in names}

    def _train_across_sites(self, settings: dict, timeout: float | None):
        """``lab.train("diloco", ..., sites=...)``: one DiLoCo model from the sites (``runs.site_diloco``)."""
        from labkit.runs.site_diloco import SitesRun

        sessions = self.site_sessions(settings.pop("sites"))
        registry = self._registry()
        assert registry.endpoint is not None, "site_sessions found sites: the line is open"
        options = {name: settings.pop(name) for name in ("inner", "wire", "quorum", "round_timeout") if name in settings}
        if settings.pop("dashboard", False):
            raise LabConfigError("dashboard is not offered for a run across sites yet: it prints each round "
                                 "(background=True returns the run: .progress(), .wait(), .stop())")
        background = settings.pop("background", False)
        run = SitesRun(self.session, registry.endpoint.hub, sessions, settings, self.session.limit(timeout),
                       reopen=registry.site_session, **options)
        return run.start_background() if background else run.run()

    def wait_for_sites(self, count: int = 1, timeout: float = 120.0, names=None) -> list[str]:
        """Wait until ``count`` sites (or the sites ``names``) have joined with all their engines; their names."""
        return self._registry().wait(count, timeout, None if names is None else list(names))

    def _registry(self) -> Sites:
        if self._sites is None:
            raise LabConfigError("a site's ranks have no sites of their own: use the lab they joined")
        return self._sites
