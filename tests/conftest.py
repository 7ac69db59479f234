"""Shared fixtures: one real 4-rank lab for the integration tests of a module."""

import psutil
import pytest

from labkit import Lab


@pytest.fixture(scope="module")
def lab():
    # Short limits keep failure tests quick; each test may pass its own timeout.
    with Lab(ranks=4, backend="gloo", threads_per_rank=1, timeout=30, interrupt_grace=3) as running:
        yield running


def ipython_shell():
    """IPython's test shell: started once per test session, shared by the modules that use magics."""
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or TerminalInteractiveShell.instance()


def lab_process_ids(lab) -> set[int]:
    return set(lab.cluster.process_ids())


def wait_gone(pids, seconds=10.0) -> set[int]:
    """The pids still alive after waiting up to ``seconds`` for them to exit."""
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p], timeout=seconds)
    return {process.pid for process in alive}


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
