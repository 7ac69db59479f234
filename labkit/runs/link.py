"""``lab.link``: set, clear and show the simulated slow link between the ranks.

The setting is checked here, before anything is sent (``spec.link.LinkSpec``
parses it and holds the model). It then lives in two places that the session
keeps together: ``session.link`` in the notebook, which every process group the
session forms hands to its ranks (so a rank replaced after a failure, or a lab
restarted, gets the same link), and each rank's ``LinkState``
(``labkit.rank.instruments.slow_link``), which delays its collectives. It is sent to idle
ranks only: a training run in progress keeps the link it started with.

Setting a link returns it (the notebook shows it, ``describe`` in a sentence);
removing one says so. A wait the lab itself spends on the link (checking a new
process group over it) is named once it lasts (``waiting_notice``), so a slow
cell does not sit silent. ``%lab link`` reads its words in ``labkit.magics.link``
and calls ``lab.link``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from labkit.spec.errors import LabConfigError
from labkit.spec.link import LinkSpec
from labkit.wire import entry

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

NOTICE_AFTER_SECONDS = 1.0  # a wait shorter than this needs no words


def set_link(session: Session, bandwidth=..., latency=...) -> LinkSpec | None:
    """Give every rank the link (``...`` for both: change nothing); return the link now in place."""
    if bandwidth is ... and latency is ...:
        return session.link
    spec = LinkSpec.parse(None if bandwidth is ... else bandwidth, None if latency is ... else latency)
    _check_recoverable(spec, session)
    if session.running:
        session.ready()  # idle ranks, broken ones replaced, before the setting changes
    previous, session.link = session.link, spec  # first: if a rank fails on the way, the next group gets it
    if session.running:
        session.call(range(session.world_size), entry.set_link, (spec,), session.start_timeout)
    if spec is None:  # nothing is returned to show, so say it
        print("simulated link removed: collectives run at this machine's speed again" if previous is not None
              else "no simulated link was set: nothing to remove")
    return spec


@contextlib.contextmanager
def waiting_notice(link: LinkSpec | None, doing: str, after: float = NOTICE_AFTER_SECONDS, say=None):
    """Say once what the notebook waits on if the ranks take more than ``after`` seconds to do
    ``doing`` over ``link`` (nothing without a link, or when the block ends first)."""
    if link is None:
        yield
        return
    text = f"waiting for the ranks to {doing} over the simulated link ({link.describe()}) ..."
    timer = threading.Timer(after, say or (lambda line: print(line, flush=True)), (text,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _check_recoverable(spec: LinkSpec | None, session: Session) -> None:
    """Refuse a link so slow that the lab could not rebuild its own process group over it.

    After a failure the ranks form a new group and check it with one small all-reduce, all
    within ``start_timeout``; the link slows that too. A link under which that all-reduce
    alone takes more than a quarter of the time would leave a lab that cannot heal."""
    if spec is None:
        return
    check = spec.seconds("all_reduce", 8, session.world_size)
    allowed = session.start_timeout / 4
    if check > allowed:
        raise LabConfigError(
            f"{spec} is too slow for this lab: its own 8-byte all-reduce, which rebuilds the process group after "
            f"a failure, would take {check:.3g} s over it, more than a quarter of start_timeout "
            f"({session.start_timeout:g} s). Use a shorter latency or a faster link (such as "
            f"lab.link('100Mbit', '20ms')), or start the lab with a longer start_timeout")


def describe(spec: LinkSpec | None, world_size: int) -> str:
    """The link in a sentence, with what it does to one all-reduce on this lab."""
    if spec is None:
        return "no simulated link: collectives run at this machine's speed"
    return f"{spec}; {spec.example(world_size)}"
