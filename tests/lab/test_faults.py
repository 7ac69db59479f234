"""Faults while the lab is idle and while it works: dead, frozen and dropped ranks healed alone,
what ranks started swept away, bad input refused with what to do (real ranks, 2 each).

Every test bounds its waits and checks that no process it caused is left.
"""

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from labkit import Lab, LabConfigError, LabError, RankFailure
from labkit.wire.entry import this_rank

from tests.conftest import started_lab, wait_gone

SCRIPTS = Path(__file__).parents[1] / "scripts"

pytestmark = pytest.mark.lab


@pytest.fixture
def pair():
    """A 2-rank lab; afterwards nothing of it may be left: no process, no listening port."""
    with started_lab(2, interrupt_grace=2) as lab:
        yield lab


def _sleepers(lab) -> list[int]:
    return [p.pid for p in psutil.Process(lab.cluster.host.pid).children(recursive=True) if p.name() == "sleep"]


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_rank_that_dies_or_freezes_while_idle_is_replaced_alone_at_the_next_call(pair, fault, capsys):
    pair.run_cell("kept = 40 + rank")
    victim = pair.status().ranks[1].pid
    generation = pair.generation
    os.kill(victim, getattr(signal, fault))
    time.sleep(3)  # long enough for the hub to drop a silent engine (heartbeats every 200 ms)
    status = pair.status()  # looking does not break, and does not repair
    assert [row.state for row in status.ranks][0] == "ready"
    assert status.ranks[1].state in ({"dead", "lost"} if fault == "SIGKILL" else {"frozen", "lost"})
    assert "the next call replaces rank 1" in status.headline()
    values = pair.run(lambda: this_rank().namespace.get("kept"))
    assert values == [40, None]  # rank 0 kept its variables; rank 1 is a fresh process
    said = capsys.readouterr().out
    assert "rank 1" in said and ("SIGKILL" in said if fault == "SIGKILL" else "frozen" in said)
    assert pair.generation == generation + 1 and pair.status().healthy
    assert wait_gone([victim], 5) == set()  # a frozen rank is killed, not left stopped


def test_mesh_and_training_heal_first_too(pair):
    os.kill(pair.status().ranks[0].pid, signal.SIGKILL)
    time.sleep(1)
    assert pair.mesh(dp=2).shape == (2,)
    os.kill(pair.status().ranks[1].pid, signal.SIGKILL)
    time.sleep(1)
    report = pair.train("ddp", "mlp", steps=2, log_every=100)
    assert report.steps_done == 2
    assert pair.run(lambda: this_rank().rank) == [0, 1]  # and the lab is not left busy


def test_a_rank_frozen_during_work_is_found_before_the_limit_and_replaced(pair):
    victim = pair.status().ranks[1].pid
    timer = threading.Timer(1.0, os.kill, (victim, signal.SIGSTOP))
    timer.start()
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        pair.run_cell("import time\nfor _ in range(400):\n    dist.all_reduce(torch.ones(1))\n    time.sleep(0.05)",
                      timeout=60)
    assert time.monotonic() - began < 20  # not the 60 s limit
    assert "rank 1 froze" in str(failure.value)
    assert wait_gone([victim], 5) == set()
    assert pair.run(lambda: this_rank().rank) == [0, 1]


def test_a_failed_training_start_leaves_the_lab_usable(pair, monkeypatch):
    from labkit import session as session_module

    def refuse(*args, **kwargs):
        raise RuntimeError("the engines could not be reached")

    monkeypatch.setattr(session_module, "RankWork", refuse)
    with pytest.raises(RuntimeError, match="could not be reached"):
        pair.train("ddp", "mlp", steps=2)
    monkeypatch.undo()
    assert pair.status().training is None
    assert pair.train("ddp", "mlp", steps=1, log_every=100).steps_done == 1


def test_stop_during_a_background_run_frees_the_lab_for_a_new_start(pair):
    run = pair.train("ddp", "mlp", steps=100000, background=True, log_every=100000)
    time.sleep(2)
    pair.stop()
    assert run.done
    pair.start()
    assert pair.run(lambda: this_rank().rank) == [0, 1]


def test_what_the_ranks_start_goes_when_they_go(pair):
    pair.run_cell("import subprocess\nchild = subprocess.Popen(['sleep', '600'])")
    sleepers = _sleepers(pair)
    assert len(sleepers) == 2
    # A replaced rank takes its own subprocesses with it ...
    os.kill(pair.status().ranks[1].pid, signal.SIGKILL)
    time.sleep(1)
    pair.run(lambda: this_rank().rank)
    assert len(wait_gone(sleepers, 5)) == 1
    # ... and stop takes everything else.
    pair.run_cell("import subprocess\norphan = subprocess.Popen(['sleep', '600'], start_new_session=True)")
    sleepers = _sleepers(pair)
    pids = set(pair.cluster.process_ids())
    pair.stop()
    assert wait_gone(set(sleepers) | pids, 10) == set()


def test_a_killed_controller_is_named_and_restart_leaves_nothing_behind(pair):
    controller = psutil.Process(pair.cluster.cluster.controller.pid)
    family = [controller.pid, *(child.pid for child in controller.children(recursive=True))]
    os.kill(controller.pid, signal.SIGKILL)
    psutil.wait_procs([controller], 5)  # the signal lands a moment after kill() returns
    with pytest.raises(LabError, match="controller exited .*SIGKILL.* call lab.restart"):
        pair.run(lambda: this_rank().rank)
    assert wait_gone(family, 10) == set()  # its scheduler processes went with it
    pair.restart()
    assert pair.run(lambda: this_rank().rank) == [0, 1]
    pids = set(pair.cluster.process_ids())
    pair.stop()
    assert wait_gone(pids, 10) == set()


def test_a_killed_process_host_is_named(pair):
    os.kill(pair.cluster.host.pid, signal.SIGKILL)
    time.sleep(1)
    with pytest.raises(LabError, match="process host exited .* call lab.restart"):
        pair.run(lambda: this_rank().rank)
    pair.restart()
    assert pair.run(lambda: this_rank().rank) == [0, 1]


def test_work_that_cannot_travel_is_explained(pair):
    with pytest.raises(LabConfigError, match="could not be sent to the ranks: cannot pickle.*pass plain data"):
        pair.run(lambda lock: 1, threading.Lock())

    def a_lock():
        import threading

        return threading.Lock()

    with pytest.raises(RankFailure, match="result could not be sent back.*return plain data") as failure:
        pair.run(a_lock)
    assert "ipyparallel" not in str(failure.value)
    assert pair.run(lambda: this_rank().rank) == [0, 1]


def test_a_module_only_the_notebook_can_import_is_named_with_the_fix(pair, tmp_path, monkeypatch):
    # A helper module beside the notebook, reached through the notebook's own sys.path entry: the ranks
    # cannot import it by name, which is how functions and classes of modules travel.
    (tmp_path / "notebook_helpers.py").write_text(
        "import torch\n\n"
        "def double(x):\n    return 2 * x\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.layer = torch.nn.Linear(4, 2)\n\n"
        "    def forward(self, x):\n        return self.layer(x)\n\n"
        "def batch(step, generator):\n"
        "    return torch.randn(4, 4, generator=generator), torch.randint(0, 2, (4,), generator=generator)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "notebook_helpers", raising=False)
    import notebook_helpers

    with pytest.raises(RankFailure, match=r"could not be read on this rank, so it did not run: No module named "
                                          r"'notebook_helpers'") as failure:
        pair.run(notebook_helpers.double, 3)
    text = "\n".join([str(failure.value), *getattr(failure.value, "__notes__", [])])
    assert "travels by name" in text and "sys.path.insert" in text and "sent back" not in text
    with pytest.raises(RankFailure, match=r"needs the module 'notebook_helpers', which the notebook imported and "
                                          r"this rank cannot.*sys.path.insert"):
        pair.train("ddp", model=notebook_helpers.Net, data=notebook_helpers.batch, steps=1, global_batch=4)
    pair.run_cell(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})")  # the fix the messages give
    assert pair.run(notebook_helpers.double, 3) == [6, 6]
    report = pair.train("ddp", model=notebook_helpers.Net, data=notebook_helpers.batch, steps=2, global_batch=4,
                        log_every=10**9)
    assert report.steps_done == 2
    pair.run_cell(f"sys.path.remove({str(tmp_path)!r})\nsys.modules.pop('notebook_helpers', None)")


def test_a_crash_in_native_code_says_which_signal_and_why(pair):
    with pytest.raises(RankFailure, match="SIGABRT .*collective whose tensor sizes"):
        pair.run_cell("import os\nif rank == 1:\n    os.abort()\ndist.barrier()", timeout=20)


def test_a_rank_that_aborted_keeps_its_log_beside_its_replacements_and_the_error_names_it(pair, capsys):
    for death in (1, 2):
        with pytest.raises(RankFailure, match="SIGABRT") as caught:
            pair.run_cell(f"import os\nif rank == 1:\n    os.write(2, b'why {death}\\n')\n    os.abort()", timeout=20)
        text = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
        kept = re.search(r"its log: (\S+)", text).group(1)
        assert kept.endswith(f"rank1.died-{death}.log")
        with open(kept) as log:
            assert f"why {death}" in log.read()
    assert pair.run_cell("rank") == ["0", "1"]
    with open(pair.cluster.log_path(1)) as log:
        assert "why" not in log.read()  # the replacement's own
    os.kill(pair.cluster.pid_of[1], signal.SIGABRT)  # while idle: the next call's note names it
    time.sleep(1)
    capsys.readouterr()
    assert pair.run_cell("rank") == ["0", "1"]
    assert re.search(r"rank 1 exited \(SIGABRT .*\(its log: \S+rank1\.died-3\.log\)", capsys.readouterr().out)


def test_a_skipped_collective_is_named_within_the_limit(pair):
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 finished while the others waited in a collective: it skipped"):
        pair.run_cell("if rank == 0:\n    dist.all_reduce(torch.ones(4))", timeout=5)
    assert time.monotonic() - began < 20


def test_a_rank_that_terminates_itself_as_its_script_ends_is_told_and_replaced_before_the_next_call(pair):
    # The engine stopped gracefully: the script was reported done, and the next call sometimes went to the
    # rank still ending ("rank 1 died"). Rounds, because it was a race.
    for _ in range(4):
        ended = pair.cluster.pid_of[1]
        with pytest.raises(RankFailure, match=r"rank 1 died(.|\n)*SIGTERM \(exit code -15\)"):
            pair.run_script(SCRIPTS / "exits.py", "terminate")
        assert pair.run_cell("rank") == ["0", "1"]
        assert pair.cluster.pid_of[1] != ended


def test_with_checked_collectives_a_mismatch_names_each_ranks_call():
    with Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=30, check_collectives=True) as lab:
        assert "collectives checked" in lab.plan.describe()
        with pytest.raises(RankFailure) as failure:
            lab.run_cell("dist.all_reduce(torch.ones(10 if rank == 0 else 20))")
        text = "\n".join([str(failure.value), *getattr(failure.value, "__notes__", [])])
        assert "rank 0 calls allreduce of shape [10] (float)" in text
        assert "rank 1 calls allreduce of shape [20] (float)" in text
        assert lab.run_cell("dist.all_reduce(torch.ones(3)); 1") == ["1", "1"]  # and it works again


def start_leavers(tag: int) -> list[int]:
    """On a rank: start two sleepers that leave the rank's process group (a session of their own,
    and a shell's orphan); ``tag`` makes their command lines this test's own."""
    import subprocess

    from labkit.wire.entry import this_rank

    mark = f"{tag}{this_rank().rank}"
    subprocess.Popen(["sleep", f"71{mark}"], start_new_session=True)
    subprocess.run(f"setsid sleep 72{mark} >/dev/null 2>&1 &", shell=True, check=True)
    return [f"71{mark}", f"72{mark}"]


def _leavers(marks) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "sleep" and (process.info["cmdline"] or [None])[-1] in marks:
            found.append(process)
    return found


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["SIGKILL", "lab.kill", "SIGSTOP"])
def test_what_a_rank_started_outside_its_group_goes_when_the_rank_is_replaced(pair, how):
    tag = {"SIGKILL": 1, "lab.kill": 2, "SIGSTOP": 3}[how]
    marks = dict(enumerate(pair.run(start_leavers, tag)))
    assert _wait_for(lambda: len(_leavers(marks[0] + marks[1])) == 4)
    kept, doomed = _leavers(marks[0]), _leavers(marks[1])
    victim = pair.cluster.pid_of[1]
    if how == "lab.kill":
        pair.kill(1)
    else:
        os.kill(victim, getattr(signal, how))
        if how == "SIGSTOP":
            assert _wait_for(lambda: 1 in pair.cluster.broken_ranks())
    assert pair.run(lambda: this_rank().rank) == [0, 1]  # rank 1 replaced
    assert wait_gone([process.pid for process in doomed], 10) == set(), "rank 1's processes outlived it"
    assert all(process.is_running() for process in kept), "rank 0's processes went with rank 1"


def test_a_rank_killed_the_instant_before_a_call_is_replaced_before_the_call(pair):
    for attempt in range(10):
        rank = attempt % 2
        if attempt % 4 < 2:
            os.kill(pair.cluster.pid_of[rank], signal.SIGKILL)
        else:
            pair.kill(rank)
        assert pair.run(lambda: this_rank().rank) == [0, 1], f"attempt {attempt}"


def test_when_every_rank_was_replaced_no_rank_is_said_to_keep_its_variables(pair, capsys):
    pair.run_cell("kept = rank")
    victims = list(pair.cluster.pid_of.values())
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(victims, 10) == set()
    assert pair.run(lambda: this_rank().namespace.get("kept")) == [None, None]
    said = capsys.readouterr().out
    assert "replaced ranks 0, 1 with fresh processes" in said
    assert "kept their variables" not in said and "every rank is a fresh process" in said
