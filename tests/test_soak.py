"""Soak: many faults in a row leave no process, file descriptor or memory behind (real ranks, 2 of them).

20 kill/heal cycles and 200 raised errors, each followed by a working call; afterwards
the lab has the same number of processes, and the notebook's process about the same
open files and memory, as before.
"""

import os
import signal

import psutil
import pytest

from labkit import Lab, RankFailure
from labkit.rank.entry import this_rank

pytestmark = pytest.mark.lab

KILLS = 20
ERRORS = 200


def _fail():
    raise ValueError("on purpose")


def test_many_kills_and_errors_leave_nothing_behind():
    me = psutil.Process()
    with Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=30, interrupt_grace=2) as lab:
        lab.run(lambda: this_rank().rank)
        processes, descriptors, memory = len(lab.cluster.process_ids()), me.num_fds(), me.memory_info().rss
        for cycle in range(KILLS):
            victim = lab.status().ranks[cycle % 2].pid
            os.kill(victim, signal.SIGKILL)
            psutil.wait_procs([psutil.Process(victim)], 5)
            lab.session.heal()
            assert lab.run(lambda: this_rank().rank) == [0, 1]
        for _ in range(ERRORS):
            with pytest.raises(RankFailure, match="ValueError: on purpose"):
                lab.run(_fail)
        assert lab.run(lambda: this_rank().rank) == [0, 1]
        assert len(lab.cluster.process_ids()) == processes
        assert me.num_fds() - descriptors <= 8, "file descriptors leak"
        assert (me.memory_info().rss - memory) / 1e6 < 64, "the notebook's memory grows with faults"
        ranks = [psutil.Process(pid) for pid in lab.cluster.pid_of.values()]
        assert all(rank.num_fds() < 200 for rank in ranks)
