"""The process host imports the ranks' modules ahead; one that is only there to save time may be missing.

A machine without debugpy (or with an ipykernel whose debugger will not import) must still
start a lab: the host skips such a module, says so in its log, and reports ready.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from labkit.cluster.hosted import process_host


def stand_in_host() -> SimpleNamespace:
    """What ``_Host.load_rank_modules`` uses of the host: its flag and its replies (kept here)."""
    replies: list[dict] = []
    return SimpleNamespace(rank_modules_loaded=False, reply=replies.append, replies=replies)


def test_a_missing_optional_module_is_skipped_and_the_host_gets_ready(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipykernel.debugger", None)  # import now raises ModuleNotFoundError
    host = stand_in_host()
    process_host._Host.load_rank_modules(host)
    assert host.rank_modules_loaded
    (ready,) = host.replies
    assert ready["event"] == "ready" and list(ready["skipped"]) == ["ipykernel.debugger"]
    assert "ModuleNotFoundError" in ready["skipped"]["ipykernel.debugger"]
    assert "ipykernel.debugger not imported ahead" in capsys.readouterr().err


def test_a_missing_required_module_still_stops_the_host(monkeypatch):
    monkeypatch.setattr(process_host, "RANK_MODULES", ("torch", "labkit_no_such_module"))
    host = stand_in_host()
    with pytest.raises(ModuleNotFoundError, match="labkit_no_such_module"):
        process_host._Host.load_rank_modules(host)
    assert host.replies == [] and not host.rank_modules_loaded


def test_the_real_host_starts_without_debugpy():
    # A fresh interpreter where debugpy cannot be imported, as on a machine that lacks it.
    code = ("import sys; sys.modules['debugpy'] = sys.modules['ipykernel.debugger'] = None; "
            "from labkit.cluster.hosted.process_host import main; main()")
    host = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = host.stdout.readline()
    finally:
        host.stdin.close()  # the host ends itself when its owner goes
        host.wait(timeout=60)
        log = host.stderr.read()
        host.stdout.close()
        host.stderr.close()
    assert line, f"the host exited before it was ready:\n{log}"
    ready = json.loads(line)
    assert ready["event"] == "ready" and "ipykernel.debugger" in ready["skipped"], log


def test_the_host_loads_the_module_engines_load_as_the_rank_runtime():
    from labkit.cluster.hosted.process_host import RANK_MODULES
    from labkit.wire.entry import RANK_RUNTIME_MODULE

    assert RANK_RUNTIME_MODULE in RANK_MODULES
