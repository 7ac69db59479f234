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
