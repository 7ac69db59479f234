"""Shared fixtures: one real 4-rank lab for the integration tests of a module."""

import contextlib
import time

import psutil
import pytest

from labkit import Lab


@contextlib.contextmanager
def started_lab(ranks: int, timeout: float = 30, interrupt_grace: float = 3):
    """A started gloo lab of ``ranks`` (one thread each) that, when the block ends, stops leaving nothing."""
    running = Lab(ranks=ranks, backend="gloo", threads_per_rank=1, timeout=timeout,
                  interrupt_grace=interrupt_grace).start()
    try:
        yield running
    finally:
        stop_leaving_nothing(running)


@pytest.fixture(scope="module")
def lab():
    # Short limits keep failure tests quick; each test may pass its own timeout.
    with started_lab(4) as running:
        yield running


def stop_leaving_nothing(lab) -> None:
    """Stop ``lab`` and check that no process or listening port of it outlives the stop, whatever
    its tests killed, froze or replaced."""
    pids, ports = set(), set()
    if lab.cluster is not None:
        pids = set(lab.cluster.process_ids())
        ports = {port for _, port, _ in lab.cluster.listening_addresses()}
    stopped = time.time()
    lab.stop()
    assert wait_gone(pids, 10) == set(), "processes outlived stop"
    # A port number may be taken again at once by a process that started later (another lab on
    # this machine): only a listener that existed before the stop outlived it.
    left = listeners_left(ports, stopped)
    assert not left, f"ports still listening after stop: {left}"


def listeners_left(ports, stopped: float) -> list:
    """Listening sockets on ``ports`` held by processes older than ``stopped`` (a time.time())."""
    return [c for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and _older_than(c.pid, stopped)]


def ipython_shell():
    """IPython's test shell: started once per test session, shared by the modules that use magics."""
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or TerminalInteractiveShell.instance()


@contextlib.contextmanager
def lab_shell(start: str):
    """IPython's shell with labkit loaded and ``%lab start {start}`` run; at the end the lab stops leaving
    nothing and the extension is unloaded."""
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "labkit")
    ip.run_line_magic("lab", f"start {start}")
    try:
        yield ip
    finally:
        stop_leaving_nothing(ip.user_ns["lab"])
        ip.run_line_magic("unload_ext", "labkit")


def lab_process_ids(lab) -> set[int]:
    return set(lab.cluster.process_ids())


def wait_gone(pids, seconds=10.0) -> set[int]:
    """The pids still alive after waiting up to ``seconds`` for them to exit."""
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p], timeout=seconds)
    return {process.pid for process in alive}


def _older_than(pid, moment: float) -> bool:
    """Whether process ``pid`` was started before ``moment`` (a time.time()); True when unknown."""
    process = _process(pid) if pid else None
    return process is None or process.create_time() < moment


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
