"""Fault handling that needs no ranks: capacity refusals, exit codes in words, stale directories."""

import json
import os
import subprocess
import sys

import pytest

from labkit import Lab
from labkit.cluster.placement import RANK_MEMORY_BYTES, DeviceError, largest_lab, plan_ranks
from labkit.cluster.workdir import OWNER_FILE, remove_stale_workdirs
from labkit.spec.errors import describe_exit


def test_more_ranks_than_the_machine_holds_are_refused_before_anything_starts():
    with pytest.raises(DeviceError, match=r"1000 ranks will not fit .* at most 32 ranks \(2 cores.*oversubscribe=True"):
        plan_ranks(1000, backend="gloo", cpu_count=2, available_memory=64 * 10**9)
    # Memory can be the tighter limit: 2 GB free holds 8 ranks of 200 MB at 80%.
    with pytest.raises(DeviceError, match=r"at most 8 ranks \(2.0 GB of memory free"):
        plan_ranks(9, backend="gloo", cpu_count=64, available_memory=2 * 10**9)
    assert plan_ranks(8, backend="gloo", cpu_count=64, available_memory=2 * 10**9).ranks == 8
    assert plan_ranks(1000, backend="gloo", cpu_count=2, available_memory=10**9, oversubscribe=True).ranks == 1000
    assert largest_lab(2, 10**12)[0] == 32 and largest_lab(64, RANK_MEMORY_BYTES)[0] == 1


@pytest.mark.parametrize("settings, message", [
    (dict(ranks=4, backend=3), "backend is a name"),
    (dict(ranks=4, oversubscribe="yes"), "oversubscribe is True or False"),
    (dict(ranks=4, timeout=float("inf")), "positive, finite"),
    (dict(ranks=4, interrupt_grace=0), "positive, finite"),
])
def test_bad_lab_settings_are_refused_with_what_to_do(settings, message):
    with pytest.raises(ValueError, match=message):
        Lab(**settings)


def test_exit_codes_in_words():
    assert describe_exit(0) == "exit code 0" and describe_exit(None) == "exit code unknown"
    assert describe_exit(-6).startswith("SIGABRT (exit code -6): aborted by torch's C++ code")
    assert "out-of-memory killer" in describe_exit(-9)
    assert describe_exit(-200) == "killed by signal 200"


def test_only_directories_of_dead_owners_are_removed(tmp_path):
    def workdir(name, owner):
        path = tmp_path / name
        path.mkdir()
        if owner is not None:
            (path / OWNER_FILE).write_text(json.dumps(owner))
        return path

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = workdir("labkit-dead", {"pid": int(finished.stdout), "started": 1.0})
    reused = workdir("labkit-reused", {"pid": os.getpid(), "started": 1.0})  # our pid, another start time
    import psutil

    alive = workdir("labkit-alive", {"pid": os.getpid(), "started": psutil.Process().create_time()})
    unknown = workdir("labkit-unknown", None)
    other = workdir("somebody-else", {"pid": int(finished.stdout)})
    removed = remove_stale_workdirs(str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert alive.exists() and unknown.exists() and other.exists() and not dead.exists()


# -- absurd values: refused before anything starts, with the range that is allowed ------------------

@pytest.mark.parametrize("settings, message", [
    (dict(ranks=2, timeout=1e15), r"timeout must be a positive, finite number of seconds, at most 604800 \(7 days\)"),
    (dict(ranks=2, start_timeout=1e15), r"start_timeout .* at most 604800"),
    (dict(ranks=2, interrupt_grace=10**12), r"interrupt_grace .* at most 604800"),
    (dict(ranks=2, start_timeout=float("nan")), "start_timeout must be a positive"),
    (dict(ranks=2, interrupt_grace=-1), "interrupt_grace must be a positive"),
    (dict(ranks=2, timeout=True), "timeout must be a positive"),
    (dict(ranks=2, threads_per_rank=10**6),
     r"threads_per_rank must be a whole number from 1 to \d+ \(this machine's cores"),
    (dict(ranks=2, threads_per_rank=10**6, oversubscribe=True),
     "threads_per_rank must be a whole number from 1 to 1024"),
    (dict(ranks=2, threads_per_rank=True), "threads_per_rank must be a whole number"),
    (dict(ranks=10**9, oversubscribe=True), "ranks must be a whole number >= 0 and at most 1024 on this machine"),
    (dict(ranks=-1), "ranks must be a whole number >= 0 and at most"),
    (dict(ranks=float("inf")), "ranks must be a whole number >= 0 and at most"),
    (dict(ranks=2, ranks_per_host=1), r"would have 2 ranks, ranks_per_host is 1: this launcher starts every rank on "
                                      r"this machine; ask for at most 1"),
])
def test_absurd_lab_settings_are_refused_with_the_range_allowed(settings, message):
    with pytest.raises(ValueError, match=message):
        Lab(**settings)


def test_absurd_call_settings_are_refused_before_anything_runs():
    lab = Lab(ranks=2)  # not started: a refusal must come before the lab is even looked at
    for absurd in (1e15, float("nan"), float("inf"), -1, 0, True):
        with pytest.raises(ValueError, match="at most 604800"):
            lab.run(print, timeout=absurd)
        with pytest.raises(ValueError, match="at most 604800"):
            lab.run_cell("1", timeout=absurd)
        with pytest.raises(ValueError, match="at most 604800"):
            lab.timeout = absurd
    assert lab.timeout == 300
    for ranks in ([2], [True], [0.5], ["1"], [], 7, "0"):
        with pytest.raises(ValueError, match=r"ranks is a rank number or a list of them, each between 0 and 1"):
            lab.run_cell("1", ranks=ranks)
    # Every rank takes seed + rank: the last rank's seed must still be in range.
    with pytest.raises(ValueError, match=r"a seed is an integer from 0 to 2\*\*63 - 2 \(rank 1 takes seed \+ 1\)"):
        lab.seed(2**63 - 1)
    with pytest.raises(ValueError, match="same is True or False"):
        lab.seed(1, same="yes")


def test_a_refused_batch_launcher_leaves_nothing_in_the_current_directory(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no sbatch there, wherever Slurm is installed
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'sbatch', which is not on this machine's PATH"):
        Lab(ranks=2, launcher="slurm")
    assert os.listdir(tmp_path) == []


def test_a_lab_of_joiners_says_how_long_it_waits_honestly(capsys, monkeypatch):
    import time

    from labkit.cluster import join
    from labkit.cluster.placement import RankPlan
    from labkit.cluster.rank_cluster import RankCluster

    cluster = RankCluster(RankPlan(backend="gloo", ranks=0, threads_per_rank=1, controller_address="10.9.8.7"),
                          start_timeout=6)
    monkeypatch.setattr(join, "join_command", lambda cluster, python="python": "python -m labkit join TOKEN")
    monkeypatch.setattr(cluster, "joiners", lambda: [])
    # Starting the controller took most of start_timeout: what is left is what the wait gets.
    assert cluster._first_joiners(time.monotonic() + 0.05) == []
    said = capsys.readouterr().out
    assert "s left of start_timeout (6 s from the start of the lab)" in said, said
    assert "python -m labkit join TOKEN" in said
