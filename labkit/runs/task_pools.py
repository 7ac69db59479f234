"""The ranks a task queue shares work among: the lab's own, and the ranks of sites that joined over HTTPS.

A ``RankPool`` is one session's ranks, each a *worker*: the lab's own ranks keep their numbers
(``3``), a site's are named with their site (``"home:1"``). The queue asks each pool which engines
may take tasks, which of its ranks cannot work, and to replace those.

The lab's ranks are replaced at once (the lab starts the processes). A site's ranks are replaced by
the site's agent, over its line: a site whose line is down, or whose agent has not yet started the
engines that replace them, is simply left out of the queue (its tasks go elsewhere) and taken back
as soon as its new engines have registered. The queue never waits for a site.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from labkit.runs.recovery import stale_reason
from labkit.spec.errors import LabError, format_ranks

if TYPE_CHECKING:
    from labkit.session import Session

Worker = int | str  # a rank of the lab, or "site:rank"


class RankPool:
    """The lab's own ranks."""

    site: str | None = None

    def __init__(self, session: Session) -> None:
        self.session = session
        self.cluster = session.require_running()
        self.replaced: set[int] = set()
        self.down: set[int] = set()  # ranks lost and not yet replaced (a site's wait for their engines)

    def worker(self, rank: int) -> Worker:
        return rank

    def workers(self) -> list[Worker]:
        return [self.worker(rank) for rank in self.cluster.ranks]

    def engines(self) -> dict[int, Worker]:
        """Engine id -> worker, for the ranks that may take tasks now."""
        return {engine: self.worker(rank) for rank, engine in self.cluster.engine_of.items() if rank not in self.down}

    def broken(self) -> dict[int, str]:
        return {rank: why for rank in self.cluster.ranks if rank not in self.down
                and (why := self.cluster.condition(rank)) is not None}

    def signal(self, ranks: list[int], signum: int) -> None:
        self.cluster.signal(ranks, signum)

    def repair(self, ranks: list[int]) -> list[int]:
        """Replace ``ranks`` (killed first if still there); the ranks that work again now."""
        try:
            self.cluster.replace(sorted(ranks))
        except Exception as error:  # noqa: BLE001
            raise LabError(f"{format_ranks(sorted(ranks))} could not be replaced ({error}); "
                           "call lab.restart() (or %lab restart)") from None
        self.replaced |= set(ranks)
        return sorted(ranks)

    def retry(self) -> list[int]:
        """Ranks left out earlier that work again now (none: the lab's are replaced at once)."""
        return []

    def finish(self) -> None:
        """After the queue: a replaced rank is not in the process groups yet, so the world is formed anew."""
        if self.replaced:
            self.session.form_group(stale_reason(self.session.generation, sorted(self.replaced)))


class SitePool(RankPool):
    """A site's ranks: replaced when its agent's new engines have come, never waited for."""

    def __init__(self, site: str, session: Session) -> None:
        super().__init__(session)
        self.site = site

    def worker(self, rank: int) -> Worker:
        return f"{self.site}:{rank}"

    def repair(self, ranks: list[int]) -> list[int]:
        self.cluster.signal(ranks, signal.SIGKILL)  # SIGKILL through the agent: a frozen or cut-off engine must not linger
        self.down |= set(ranks)
        return self.retry()

    def retry(self) -> list[int]:
        if not self.down or self.cluster.infrastructure_problem() is not None:
            return []
        link = self.cluster.link()  # type: ignore[attr-defined]
        if link is None or not link.connected or len(self.cluster.waiting()) < len(self.down):  # type: ignore[attr-defined]
            return []
        back = sorted(self.down)
        try:
            self.cluster.replace(back, timeout=10.0)
        except LabError:
            return []
        self.down.clear()
        self.replaced |= set(back)
        return back

    def finish(self) -> None:
        if self.down:
            return  # the site's next call heals it (its group is formed then)
        super().finish()
