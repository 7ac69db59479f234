"""The ranks of one site: engines of the lab's own controller that came over the site's line.

A ``SiteCluster`` is a ``RankCluster`` that starts no process and owns no controller: it shares the
lab's client, adopts the engines whose slot names its site (``engines.SITE_PREFIX``), and makes them
ranks 0..n-1 of a world of their own, which a ``Session`` of its own forms into a torch.distributed
group on the site's loopback. So everything a lab does with ranks (cells, ``run``, ``push``, meshes,
``train``, heal) works on a site as on the lab itself, through the one line.

What differs is how a rank is seen and replaced. The site's agent reports at once when an engine's
process ends (``SiteLink.exits``); the controller drops an engine whose heartbeats stop (frozen, or
the line down). A rank is replaced by asking the agent to kill its process: the agent starts another,
which registers, and is adopted in its place. A site whose line ended cannot be healed from here:
it comes back when the join command runs there again.
"""

from __future__ import annotations

import signal
import time

from labkit.cluster import engines
from labkit.cluster.health import DROPPED
from labkit.cluster.launchers import LauncherChoice
from labkit.cluster.placement import RankPlan
from labkit.cluster.rank_cluster import RankCluster
from labkit.spec.errors import LabError, StartupError, describe_exit, format_ranks

SITE_LAUNCHER = LauncherChoice("site", object)  # no launcher: the site's agent starts the engines
POLL_SECONDS = 0.05


def registered_engines(parent: RankCluster, site: str, line_session: str) -> list[int]:
    """The engines of ``site`` (come over that line session) that the lab's controller has registered now."""
    if parent.client is None:
        return []
    found = engines.describe(parent, [engine for engine in parent.client.ids if engine not in parent.retired_engines
                                      and engine not in parent.engine_of.values()])
    return sorted(engine for engine, info in found.items() if engines.site_of(info["slot"]) == site
                  and engines.line_session_of(info["slot"]) == line_session)


class SiteCluster(RankCluster):
    def __init__(self, parent: RankCluster, endpoint, name: str, plan: RankPlan, start_timeout: float):
        super().__init__(plan, start_timeout=start_timeout, launcher=SITE_LAUNCHER)
        self.parent, self.endpoint, self.site = parent, endpoint, name
        link = endpoint.hub.sites().get(name)
        self.line_session = link.session if link is not None else None  # its engines came over this line
        self.descriptions = parent.descriptions  # one answer per engine for the whole lab

    # -- start: adopt the site's engines ---------------------------------------------

    def start(self) -> None:
        self.client = self.parent.client
        self.workdir = self.parent.workdir
        self._connection = self.parent.engine_connection()
        deadline = time.monotonic() + self.start_timeout
        found = self._wait_for_engines(self.plan.ranks, deadline)
        self._reached("engines registered")
        self._assign(found, list(range(len(found))), deadline)
        self._reached("ranks assigned")

    def waiting(self) -> list[tuple[int, dict]]:
        """Registered engines of this site that are not ranks (yet), oldest first."""
        assert self.client is not None
        return sorted((engine, info) for engine, info in engines.describe(self, engines.new_engines(self)).items()
                      if engines.site_of(info["slot"]) == self.site
                      and engines.line_session_of(info["slot"]) == self.line_session)

    def _wait_for_engines(self, count: int, deadline: float) -> list[tuple[int, dict]]:
        while True:
            found = self.waiting()
            if len(found) >= count:
                return found[:count]
            problem = self.infrastructure_problem()
            if problem or time.monotonic() > deadline:
                raise StartupError(f"site {self.site!r} has {len(found)} of the {count} engine(s) it needs after "
                                   f"{self.start_timeout:g} s{': ' + problem if problem else ''}. Its join "
                                   "command prints what it is doing")
            time.sleep(POLL_SECONDS)

    def _assign(self, found, ranks, deadline) -> None:
        # A site's ranks see the controller at the local ends of the line: those are the ports to keep free.
        link = self.link()
        ports = link.local_ports if link is not None else []
        self._connection = {f"line{index}": port for index, port in enumerate(ports)} or self._connection
        super()._assign(found, ranks, deadline)

    def engine_connection(self) -> dict:
        return self._connection or self.parent.engine_connection()

    def store_address(self, host: str, port: int) -> tuple[str, int]:
        """Rank 0's store is on the site's loopback: the notebook reaches it through the line."""
        return "127.0.0.1", self.endpoint.hub.forward(self.site, port)

    def joiners(self) -> list[tuple[int, dict]]:
        return []  # a site has the ranks its join command asked for; more come with another site

    # -- health ----------------------------------------------------------------------

    def link(self):
        """What the hub knows of this site's line (None once the site joined anew: that is another line)."""
        link = self.endpoint.hub.sites().get(self.site)
        return link if link is not None and link.session == self.line_session else None

    def infrastructure_problem(self) -> str | None:
        problem = self.parent.infrastructure_problem()
        if problem:
            return problem
        link = self.link()
        if link is None:
            return (f"site {self.site!r} joined anew (or left): these ranks came over its earlier line and are gone; "
                    f"lab.site({self.site!r}) has its new ranks")
        if link.gone:
            return (f"site {self.site!r} left the lab (its line ended); run the join command there again to bring "
                    "it back")
        return None

    def condition(self, rank: int) -> str | None:
        record = self.records.get(rank)
        if record is None:
            return "has no process"
        link = self.link()
        if link is not None and record.pid in link.exits:
            return f"exited ({describe_exit(link.exits[record.pid])})"
        if link is None or link.gone:
            return "was lost with its site's line"
        if self.client is not None and record.engine not in self.client.ids:
            return DROPPED
        return None

    # -- signals and replacement -------------------------------------------------------

    def signal(self, ranks, signum: int = signal.SIGINT) -> None:
        """Through the nanny while the controller lists the engine; through the site's agent otherwise."""
        nanny: list = []
        direct: list = []
        for rank in ranks:
            record = self.records.get(rank)
            if record is None:
                continue
            (nanny if self.client is not None and record.engine in self.client.ids else direct).append(record)
        if nanny and self.client is not None:
            try:
                self.client.send_signal(signum, targets=[record.engine for record in nanny], block=False)
            except Exception:  # noqa: BLE001 - dropped meanwhile: the agent below reaches it
                direct += nanny
        operation = "kill" if signum == signal.SIGKILL else "signal"
        if direct or signum == signal.SIGKILL:  # SIGKILL goes to the agent too: it may be frozen
            pids = [record.pid for record in (direct if signum != signal.SIGKILL else nanny + direct)]
            self.endpoint.hub.tell(self.site, {"op": operation, "pids": pids, "signum": int(signum)})

    def replace(self, ranks, timeout: float | None = None) -> None:
        """Ask the site's agent to end these ranks' processes; adopt the engines it starts in their place."""
        ranks = sorted(ranks)
        problem = self.infrastructure_problem()
        if problem:
            raise LabError(f"{format_ranks(ranks)} of site {self.site!r} cannot be replaced: {problem}")
        self.signal(ranks, signal.SIGKILL)
        for rank in ranks:
            self.retired_engines.add(self.records.pop(rank).engine)
        deadline = time.monotonic() + (timeout or self.start_timeout)
        self._assign(self._wait_for_engines(len(ranks), deadline), ranks, deadline)

    def listening_addresses(self) -> list[tuple[str, int, int]]:
        return []  # on the site's machine: nothing of it listens here

    def process_ids(self) -> list[int]:
        return []

    def warm_host(self) -> None:
        pass

    def stop(self) -> None:
        """Let the ranks go (the engines stay with the site's agent, which ends them when the lab stops)."""
        self.records.clear()
        self.retired_engines.clear()
        self.client = None
