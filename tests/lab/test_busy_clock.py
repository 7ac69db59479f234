"""The busy-time clock sees the rank's main thread, also in a process forked from a warm parent.

Busy time is CPU time plus run delay (time ready to run but waiting for a core). The lab's ranks
are forked from a process host; a clock that missed the run delay there would count a slowed rank
as idle whenever it waits for a core, and a straggler on a loaded machine would go unseen.
"""

import os
import time

import pytest

from labkit.rank.instruments.recorder import MainThreadClock

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")
                                or not hasattr(os, "sched_setaffinity"),
                                reason="the kernel reports no run delay (schedstat)")

SPIN_SECONDS = 0.2


def _spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _busy_while_sharing_a_core() -> float:
    """In this process: busy seconds counted for a spin of SPIN_SECONDS that shares one core with
    another spinning process, so about half of it is spent waiting for the core."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    rival = os.fork()
    if rival == 0:
        _spin(10 * SPIN_SECONDS)
        os._exit(0)
    try:
        clock = MainThreadClock()
        began = clock.busy()
        _spin(SPIN_SECONDS)
        return clock.busy() - began
    finally:
        os.kill(rival, 9)
        os.waitpid(rival, 0)


def test_a_forked_process_counts_the_time_it_waits_for_a_core():
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # a process forked as the lab's ranks are
        os.close(reader)
        try:
            os.write(writer, repr(_busy_while_sharing_a_core()).encode())
        finally:
            os._exit(0)
    os.close(writer)
    answer = os.read(reader, 64)
    os.close(reader)
    os.waitpid(child, 0)
    busy = float(answer)
    # All of the spin is busy: running, or ready to run and waiting for the core (CPU time alone
    # would be about half of it).
    assert busy > 0.8 * SPIN_SECONDS, busy
