"""A Ctrl-C while a ``%%lab`` cell trains a DDP model: every rank stops before its next iteration.

The kernel's interrupt reaches the notebook, not the ranks. Signalled, each rank stops wherever it is: one
just past its optimizer step, another just before it, and the model's replicas differ from then on. So when
a rank says (in its whereabouts) that a DDP model trains in the work, the notebook first asks, through the
control channel, for a stop as the next DDP forward begins (``rank.model_steps``), and gives the ranks a few
seconds to get there; a rank that went on into the next iteration waits in its first collective for those
that stopped, and the deadlock watch releases it. Only ranks still working after that are signalled
(``runs.dispatch``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from labkit.spec.errors import LabError

if TYPE_CHECKING:
    from labkit.session import Session

# How long ranks training a DDP model get to reach their next forward after a Ctrl-C (a rank that went on
# is released from its first collective within a second).
GRACE_SECONDS = 5.0


def stop_before_iteration(session: Session) -> float:
    """The kernel was interrupted while the session's foreground work runs: if a rank trains a DDP model, ask
    every rank to stop before its next iteration; the seconds to give them before they are interrupted."""
    work = session.foreground
    if work is None or not any(state.get("iterating") for state in work.whereabouts.values()):
        return 0.0
    try:
        session.control.request_stop(True)
    except LabError:  # the store cannot be reached (rank 0 frozen or gone): interrupt at once
        return 0.0
    return GRACE_SECONDS


@contextlib.contextmanager
def iteration_stops(session: Session):
    """Work inside may be stopped by ``stop_before_iteration``; the stop is taken back when it ends, so
    the next work does not find it."""
    try:
        yield
    finally:
        if session.control.stop:
            session.control.request_stop(False)
