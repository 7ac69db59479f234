"""The ranks' names from the notebook: completion of code the ranks will run, and ``lab.who``.

Neither is user work, so neither goes through ``Session.execute`` (which heals, watches and shows
output): each sends one ``wire.entry`` function straight to the engines and waits a bounded time.

- Completion asks one rank and waits ``COMPLETION_WAIT_SECONDS`` at most, because the notebook's
  kernel waits with it: a rank that answers later (frozen, or busy with something) is abandoned,
  its request withdrawn if it has not started. While a run holds the ranks, or a call waits for
  them, no rank is asked at all: their queues are busy, and the answer would come after the run.
- ``who`` asks every rank named, the idle ones only (``Session.require_idle``), and lists the
  ranks that could not answer in time beside the table instead of failing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from labkit.views.rank_variables import RankVariables
from labkit.wire import entry

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.cluster.rank_cluster import RankCluster
    from labkit.session import Session

COMPLETION_WAIT_SECONDS = 0.3  # what a Tab may cost; past it the notebook's own completions stand alone
WHO_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class RankCompletion:
    """One completion a rank offers: ``text`` replaces ``code[start:end]`` (as IPython's ``Completion``)."""

    start: int
    end: int
    text: str
    type: str


def completion_rank(session: Session, ranks: Any) -> int:
    """The rank that completes for ``ranks`` (None: rank 0; a rank; a list: its first as written), checked."""
    if ranks is None:
        return 0
    session.targets(ranks)  # refuses what names no rank of this lab
    return ranks if isinstance(ranks, int) else list(ranks)[0]


def complete(session: Session, code: str, offset: int, ranks: Any = None,
             wait: float = COMPLETION_WAIT_SECONDS) -> list[RankCompletion]:
    """What ``code`` completes to at ``offset`` in the namespace of the rank ``completion_rank`` picks, or []
    when the lab is not running, the ranks are held or that rank does not answer within ``wait`` seconds."""
    if not 0 <= offset <= len(code):
        raise ValueError(f"the cursor is a position in the code, 0 to {len(code)}; got {offset}")
    cluster = session.cluster
    if cluster is None or session.busy_with is not None or session.foreground is not None:
        return []
    rank = completion_rank(session, ranks)
    try:
        pending = cluster.engine(rank).apply_async(entry.complete_names, code, offset)
    except Exception:  # a rank whose engine the controller dropped cannot be addressed
        return []
    if not pending.wait(wait):
        abandon(cluster, rank, pending)
        return []
    try:
        found = pending.get(0)
    except Exception:
        return []
    return [RankCompletion(start, end, text, kind) for start, end, text, kind in found]


def abandon(cluster: RankCluster, rank: int, pending: Any) -> None:
    """Withdraw ``rank``'s request if it has not started (a frozen rank runs nothing of it when it wakes); one that
    has started ends on its own, and its answer is dropped."""
    try:
        if cluster.client is not None:
            cluster.client.abort(jobs=pending.msg_ids, targets=[cluster.engine_of[rank]], block=False)
    except Exception:  # the engine is gone already: nothing of it is left to run
        pass


def who(session: Session, ranks: Any = None, timeout: float = WHO_TIMEOUT_SECONDS) -> RankVariables:
    """The user variables of ``ranks`` (None: all), each rank asked at once; raises ``LabBusy`` while a run holds
    them. A rank that cannot work, fails, or does not answer within ``timeout`` seconds is named in the table's
    notes instead."""
    cluster = session.require_idle()
    missing: dict[int, str] = {}
    pending = {}
    for rank in session.targets(ranks):
        condition = cluster.condition(rank)
        if condition is not None:
            missing[rank] = condition
            continue
        pending[rank] = cluster.engine(rank).apply_async(entry.describe_names)
    deadline = time.monotonic() + timeout
    found = {}
    for rank, result in pending.items():
        if not result.wait(max(0.0, deadline - time.monotonic())):
            abandon(cluster, rank, result)
            missing[rank] = f"did not answer within {timeout:g} s"
            continue
        try:
            found[rank] = result.get(0)
        except Exception as error:
            kind = getattr(error, "ename", type(error).__name__)
            missing[rank] = f"failed: {kind}: {getattr(error, 'evalue', error)}"
    return RankVariables(found, missing)
