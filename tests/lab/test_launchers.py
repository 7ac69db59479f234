"""Launchers other than the lab's own, on real engines: ipyparallel's MPI launcher (MPICH's mpiexec),
its local launcher, and engines that join with ``python -m labkit join``.

Signals reach these ranks through ipyparallel (the nanny beside each engine), and the lab
learns that a rank is gone from the controller's heartbeats, as it would on a cluster.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time

import pytest

from labkit import Lab
from labkit.cluster.launchers import choose_launcher

pytestmark = pytest.mark.lab


def _mpi_missing() -> str | None:
    try:
        choose_launcher("mpi")
        import mpi4py  # noqa: F401 - ipyparallel's MPI engines number themselves with it
    except Exception as error:  # noqa: BLE001 - the reason is the skip message
        return str(error)
    return None


def who() -> tuple[int, int]:
    """(rank, world size), asked on a rank."""
    from labkit.wire.entry import this_rank

    here = this_rank()
    return here.rank, here.world_size


def pmi_rank():
    import os

    return os.environ.get("PMI_RANK")


def wait_for(condition, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(_mpi_missing() is not None, reason=f"no MPI here: {_mpi_missing()}")
def test_mpi_launched_ranks_train_and_a_killed_rank_takes_its_mpi_job_and_is_healed():
    lab = Lab(ranks=2, launcher="mpi", start_timeout=90, timeout=60)
    try:
        lab.start()
        assert lab.launcher.name == "mpi"
        assert lab.run(who) == [(0, 2), (1, 2)]
        assert sorted(lab.run(pmi_rank)) == ["0", "1"]  # started by mpiexec, whatever rank each became
        lab.kill(1)
        # MPI ends the whole job when one of its processes dies: both ranks are gone, and the lab says so.
        assert wait_for(lambda: len(lab.cluster.broken_ranks()) == 2, 20), lab.cluster.broken_ranks()
        note = lab.session.heal()
        assert "replaced ranks 0, 1" in note
        report = lab.train(strategy="ddp", model="mlp", steps=3, verify=True, log_every=100)
        assert report.equivalent is True
    finally:
        lab.stop()
    assert _processes_named("hydra_pmi_proxy") == [], "MPI's proxies outlived the lab"


def test_ipyparallels_local_launcher_signals_through_the_nanny_and_heals_a_frozen_rank():
    lab = Lab(ranks=2, launcher="local", start_timeout=90, timeout=30)
    try:
        lab.start()
        pids = lab.cluster.pid_of
        frozen = pids[1]
        import os

        os.kill(frozen, signal.SIGSTOP)  # frozen: to the controller it stops answering heartbeats
        assert wait_for(lambda: 1 in lab.cluster.broken_ranks(), 20)
        assert "dropped by the controller" in lab.cluster.broken_ranks()[1]
        note = lab.session.heal()  # the nanny delivers the SIGKILL the frozen process cannot refuse
        assert "replaced rank 1" in note
        assert wait_for(lambda: not _alive(frozen), 10), "the frozen process was left behind"
        assert lab.run(who) == [(0, 2), (1, 2)]
    finally:
        lab.stop()


def _processes_named(fragment: str) -> list[int]:
    """Living processes of this machine whose command line holds ``fragment``."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if fragment in " ".join(process.info["cmdline"] or []) and _alive(process.pid):
            found.append(process.pid)
    return found


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_engine_joins_as_the_next_rank_and_leaves_when_the_lab_stops():
    lab = Lab(ranks=2, timeout=30)
    joiner = None
    try:
        lab.start()
        command = lab.join_command(python=sys.executable)
        joiner = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert lab.world_size == 2  # it joins at the next start or heal, not in the middle of work
        assert wait_for(lambda: lab.session.heal() is not None, 60)
        assert lab.world_size == 3
        assert lab.run(who) == [(0, 3), (1, 3), (2, 3)]
        assert lab.cluster.records[2].joined
        # Killed, a joined rank cannot be restarted from here: the lab shrinks back and goes on.
        lab.session.cluster.signal([2], signal.SIGKILL)
        assert wait_for(lambda: 2 in lab.cluster.broken_ranks(), 20)
        note = lab.session.heal()
        assert "dropped rank 2, which joined from another machine" in note and lab.world_size == 2
        assert lab.run(who) == [(0, 2), (1, 2)]
        assert joiner.wait(20) is not None  # its join command ended with its engine
    finally:
        lab.stop()
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


def test_a_joined_rank_lost_while_idle_is_dropped_by_the_next_call_and_its_folder_goes(tmp_path):
    import os

    lab = Lab(ranks=2, timeout=30)
    joiner = None
    try:
        lab.start()
        # The joiner makes its temporary folder where TMPDIR says: here, where the test can look.
        joiner = subprocess.Popen(shlex.split(lab.join_command(python=sys.executable)), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=dict(os.environ, TMPDIR=str(tmp_path)))
        assert wait_for(lambda: lab.session.heal() is not None, 60) and lab.world_size == 3
        assert len(list(tmp_path.glob("labkit-join-*"))) == 1
        os.kill(lab.cluster.records[2].pid, signal.SIGKILL)  # its engine ends, as on a machine that failed
        assert wait_for(lambda: 2 in lab.cluster.broken_ranks(), 20)
        # The next call heals first (the lab shrinks to 2 ranks), then targets every rank it has now.
        assert lab.run(who) == [(0, 2), (1, 2)]
        assert lab.run_cell("rank") == ["0", "1"]
        assert joiner.wait(20) is not None  # its join command ended with its engine ...
        assert list(tmp_path.glob("labkit-join-*")) == []  # ... and removed its folder
    finally:
        lab.stop()
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


def test_a_joined_rank_frozen_while_idle_is_dropped_before_the_next_call_and_a_late_reply_is_one_line(capsys):
    import os

    lab = Lab(ranks=2, timeout=30)
    joiner = None
    try:
        lab.start()
        joiner = subprocess.Popen(shlex.split(lab.join_command(python=sys.executable)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        assert wait_for(lambda: lab.session.heal() is not None, 60) and lab.world_size == 3
        frozen = lab.cluster.records[2].pid
        os.kill(frozen, signal.SIGSTOP)
        capsys.readouterr()
        # At once, as for a frozen rank of this machine: the call waits for the controller's verdict, the heal
        # before it drops the rank, and the call runs on the ranks left (it failed, and the one after worked).
        assert lab.run_cell("rank") == ["0", "1"]
        assert "rank 2 was dropped by the controller" in capsys.readouterr().out
        os.kill(frozen, signal.SIGCONT)  # it answers the request it could not answer frozen
        assert wait_for(lambda: "late reply" in capsys.readouterr().out, 10)
        assert lab.run_cell("rank") == ["0", "1"]
        said = capsys.readouterr().out
        assert "got stale result" not in said and "apply_reply" not in said  # ipyparallel's raw prints
    finally:
        lab.stop()
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL", "frozen engine"])
def test_a_join_command_ended_any_way_leaves_no_folder(tmp_path, how):
    import os

    from labkit.cluster.workdir import remove_stale_workdirs

    lab = Lab(ranks=1, timeout=30)
    joiner = None
    try:
        lab.start()
        joiner = subprocess.Popen(shlex.split(lab.join_command(python=sys.executable)), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=dict(os.environ, TMPDIR=str(tmp_path)))
        assert wait_for(lambda: lab.session.heal() is not None, 60) and lab.world_size == 2
        assert len(list(tmp_path.glob("labkit-join-*"))) == 1
        if how == "frozen engine":  # nobody resumes it: the join command ends it, and itself
            os.kill(lab.cluster.records[1].pid, signal.SIGSTOP)
        else:
            joiner.send_signal(getattr(signal, how))
        assert joiner.wait(20) is not None
        if how == "SIGKILL":  # nothing runs to clean up: the next join command or lab on the machine does
            assert len(list(tmp_path.glob("labkit-join-*"))) == 1
            remove_stale_workdirs(str(tmp_path))
        assert list(tmp_path.glob("labkit-join-*")) == []
    finally:
        lab.stop()
        if joiner is not None and joiner.poll() is None:
            joiner.kill()


def test_a_joined_engine_is_asked_to_leave_when_the_lab_stops():
    lab = Lab(ranks=1, timeout=30)
    joiner = None
    try:
        lab.start()
        joiner = subprocess.Popen(shlex.split(lab.join_command(python=sys.executable)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        assert wait_for(lambda: lab.session.heal() is not None, 60) and lab.world_size == 2
    finally:
        lab.stop()
    try:
        assert joiner.wait(20) is not None, "the joined engine outlived the lab"
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert "left the lab" in joiner.stdout.read()


def test_a_join_command_of_a_lab_that_stopped_ends_and_says_why():
    lab = Lab(ranks=1)
    lab.start()
    command = lab.join_command(python=sys.executable)
    lab.stop()
    joiner = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=90)
    assert joiner.returncode != 0
    assert "could not register" in joiner.stdout and "good for one lab run" in joiner.stdout


def test_a_mangled_join_command_is_refused_at_once():
    refused = subprocess.run([sys.executable, "-m", "labkit", "join", "not-a-token"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "not a lab's join token" in refused.stderr


LAB_OF_JOINERS = """
import sys
from labkit import Lab

def who():
    from labkit.wire.entry import this_rank
    return (this_rank().rank, this_rank().world_size, this_rank().address)

lab = Lab(ranks=0, controller_address=sys.argv[1], start_timeout=90)
lab.start()
print("ranks:", lab.run(who), flush=True)
lab.stop()
"""


def _outside_address() -> str | None:
    from labkit.spec.network import ipv4_addresses

    found = [address for addresses in ipv4_addresses().values() for address in addresses
             if not address.startswith("127.")]
    return found[0] if found else None


@pytest.mark.skipif(_outside_address() is None, reason="this machine has no address besides loopback")
def test_a_lab_of_no_ranks_of_its_own_prints_its_join_command_and_waits_for_a_machine():
    address = _outside_address()
    lab = subprocess.Popen([sys.executable, "-c", LAB_OF_JOINERS, address], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    joiner = None
    try:
        lines = []
        for line in lab.stdout:
            lines.append(line)
            if line.startswith(f"{sys.executable} -m labkit join ") or line.startswith("python -m labkit join "):
                command = line.split()
                joiner = subprocess.Popen([sys.executable, *command[1:]], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
            if line.startswith("ranks:"):
                break
        assert any("waiting for machines to join" in line and "of start_timeout (90 s from the start" in line
                   for line in lines), lines
        assert lines[-1].strip() == f"ranks: [(0, 1, '{address}')]", lines
        assert lab.wait(30) == 0
        assert joiner.wait(30) is not None
    finally:
        for process in (lab, joiner):
            if process is not None and process.poll() is None:
                process.kill()
