"""Soak: many faults in a row leave no process, file descriptor or memory behind (real ranks, 2 of them).

20 kill/heal cycles and 200 raised errors, each followed by a working call; afterwards
the lab has the same number of processes, and the notebook's process about the same
open files and memory, as before. And mixed failing cells over a DDP, an FSDP2 and a
tensor-parallel model built once, each trained on after every failure: they end bitwise
as without the failures, and the ranks' descriptors and memory stay flat.
"""

import os
import signal

import psutil
import pytest

from labkit import Lab, RankFailure
from labkit.wire.entry import this_rank
from tests.conftest import started_lab
from tests.survivor_cells import BUILD, COMPARE, FAILURES, TIMEOUTS

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
            victim = psutil.Process(lab.status().ranks[cycle % 2].pid)  # before the kill: the lab may reap it first
            os.kill(victim.pid, signal.SIGKILL)
            psutil.wait_procs([victim], 5)
            lab.session.heal()
            assert lab.run(lambda: this_rank().rank) == [0, 1]
            if cycle == 0:  # the first heal loads what the notebook keeps for any later one (55 MB measured)
                memory = me.memory_info().rss
        for _ in range(ERRORS):
            with pytest.raises(RankFailure, match="ValueError: on purpose"):
                lab.run(_fail)
        assert lab.run(lambda: this_rank().rank) == [0, 1]
        assert len(lab.cluster.process_ids()) == processes
        assert me.num_fds() - descriptors <= 8, "file descriptors leak"
        assert (me.memory_info().rss - memory) / 1e6 < 64, "the notebook's memory grows with faults"
        ranks = [psutil.Process(pid) for pid in lab.cluster.pid_of.values()]
        assert all(rank.num_fds() < 200 for rank in ranks)


MIXED_FAILURES = 20  # bench/recovery.py --soak runs 50


def rank_usage() -> tuple[int, int]:
    """This rank's open file descriptors and resident memory."""
    import gc

    gc.collect()
    me = psutil.Process()
    return me.num_fds(), me.memory_info().rss


def test_mixed_failures_over_models_built_once_end_as_without_them_with_flat_descriptors_and_memory():
    kinds = [(code, None) for _, code, _ in FAILURES] + [(code, limit) for _, code, _, limit in TIMEOUTS]
    with started_lab(2, timeout=60) as lab:
        lab.run_cell(BUILD)
        lab.run_cell("models, optimizers, group = build()\nSTEPS = 0")
        for round_ in range(MIXED_FAILURES + len(kinds)):  # the first of each kind warms what torch makes once
            if round_ == len(kinds):
                before = lab.run(rank_usage)
            code, limit = kinds[round_ % len(kinds)]
            with pytest.raises(RankFailure):
                lab.run_cell(code, timeout=limit)
            lab.run_cell("train(models, optimizers, group, STEPS); STEPS += 1")
        after = lab.run(rank_usage)
        lab.run_cell(COMPARE)
        assert lab.run(lambda: __import__("IPython").get_ipython().user_ns["same"]) == [True, True]
        for (descriptors, memory), (now_descriptors, now_memory) in zip(before, after):
            assert now_descriptors - descriptors <= 4, "descriptors grow with failures"
            assert (now_memory - memory) / 1e6 < 40, "a rank's memory grows with failures"
