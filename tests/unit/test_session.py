"""The session's seam with long work (``runs.holder.RunHolder``): who holds the ranks, and what a stop asks of it.

No ranks start: the session gets a stand-in for its cluster.
"""

import pytest

from labkit import Lab, LabBusy


class FakeCluster:
    world_size = 2

    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


class Holder:
    """Long work as the session sees it: done, status, stop, finished."""

    def __init__(self, status="a test holder at step 3"):
        self.done = False
        self.said = status
        self.stop_asked = False
        self.waited_for = None

    def status(self):
        return self.said

    def stop(self):
        self.stop_asked = True

    def finished(self, timeout=None):
        self.waited_for = timeout
        return True


@pytest.fixture
def session():
    session = Lab(ranks=2).session
    session.cluster = FakeCluster()
    return session


def test_a_holder_keeps_other_work_out_until_it_is_released(session):
    holder = Holder()
    session.claim(holder)
    assert session.busy_with == "a test holder at step 3"
    with pytest.raises(LabBusy, match="a test holder at step 3"):
        session.require_idle()
    with pytest.raises(LabBusy):
        session.claim(Holder("another"))
    session.release(Holder("another"))  # only the holder itself lets go
    assert session.busy_with == "a test holder at step 3"
    session.release(holder)
    assert session.busy_with is None
    assert session.require_idle() is session.cluster


def test_a_holder_that_is_done_holds_nothing(session):
    holder = Holder()
    session.claim(holder)
    holder.done = True
    assert session.busy_with is None
    session.claim(Holder("the next one"))  # not refused
    assert session.busy_with == "the next one"


def test_stopping_the_lab_asks_the_holder_to_stop_and_waits_for_it(session):
    cluster, holder = session.cluster, Holder()
    session.claim(holder)
    session.stop()
    assert holder.stop_asked and holder.waited_for == 10
    assert cluster.stopped and session.cluster is None and session.busy_with is None
