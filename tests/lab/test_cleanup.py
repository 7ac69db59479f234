"""Nothing is left behind: after stop, failed starts, interpreter exit, a killed owner
and a kernel shutdown, no rank, controller or host process and no port survives."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from labkit import Lab, StartupError
from labkit.cluster.rank_cluster import RankCluster

from tests.conftest import listeners_left, wait_gone

pytestmark = pytest.mark.lab

OWNER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from labkit import Lab
    lab = Lab(ranks=2, backend="gloo", threads_per_rank=1).start()
    print(json.dumps(lab.cluster.process_ids()), flush=True)
    print(lab.cluster.workdir, flush=True)
    lab.run_cell("import subprocess; child = subprocess.Popen(['sleep', '600'])")
    print(json.dumps(lab.cluster.process_ids()), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    """
)


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_stop_leaves_no_process_port_or_file():
    lab = Lab(ranks=2, backend="gloo", threads_per_rank=1).start()
    pids = set(lab.cluster.process_ids())
    ports = {port for _, port, _ in lab.cluster.listening_addresses()}
    workdir = lab.cluster.workdir
    assert len(pids) >= 4  # host, controller, two ranks
    stopped = time.time()
    lab.stop()
    lab.stop()  # twice is fine
    assert wait_gone(pids, 1) == set()
    assert not listeners_left(ports, stopped)
    assert not os.path.exists(workdir)


def test_rank_that_cannot_start_is_named_and_nothing_is_left(monkeypatch):
    before = _children()
    original = RankCluster._engine_args
    calls = []

    def broken_for_rank_1(self):
        args = original(self)
        calls.append(1)
        if len(calls) == 2:  # the second engine set is rank 1
            args.append("--IPEngine.timeout=not-a-number")
        return args

    monkeypatch.setattr(RankCluster, "_engine_args", broken_for_rank_1)
    with pytest.raises(StartupError, match="rank 1 exited while starting") as caught:
        Lab(ranks=3, backend="gloo", threads_per_rank=1, start_timeout=60).start()
    assert "Nothing was left running" in str(caught.value)
    assert wait_gone(_children() - before, 10) == set()


def test_start_deadline_is_kept():
    before = _children()
    with pytest.raises(StartupError, match="within 0.5 s"):
        Lab(ranks=2, backend="gloo", start_timeout=0.5).start()
    assert wait_gone(_children() - before, 10) == set()


@pytest.mark.parametrize("ending", ["exit", "hang"])
def test_owner_exit_or_death_takes_the_lab_with_it(ending):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, ending], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    pids = set(json.loads(owner.stdout.readline()))
    workdir = owner.stdout.readline().strip()
    pids |= set(json.loads(owner.stdout.readline()))  # with the ranks' own subprocesses
    assert len(pids) >= 6
    assert {oct(os.stat(os.path.join(folder, name)).st_mode & 0o777) for folder, _, names in os.walk(workdir)
            for name in names} == {"0o600"}  # every file of the lab is its owner's only
    if ending == "hang":
        owner.send_signal(signal.SIGKILL)  # no atexit: the host notices its owner is gone
    owner.wait(60)
    assert wait_gone(pids, 15) == set()
    if ending == "hang":  # nobody removed its directory; the next lab that starts does
        assert os.path.exists(workdir)
        with Lab(ranks=1, backend="gloo", threads_per_rank=1):
            assert not os.path.exists(workdir)
    else:
        assert not os.path.exists(workdir)


def test_kernel_shutdown_stops_the_lab():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        client.execute_interactive("%load_ext labkit", timeout=60)
        client.execute_interactive("%lab start 2 --backend gloo --threads 1", timeout=120)
        collected = []
        client.execute_interactive(
            "print(__import__('json').dumps(lab.cluster.process_ids()))",
            timeout=60,
            output_hook=lambda msg: collected.append(msg["content"].get("text", "")),
        )
        pids = set(json.loads("".join(collected)))
        assert len(pids) >= 4
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    assert wait_gone(pids, 15) == set()
