"""The rank's debugger in this process: post-mortem on a real traceback, and a breakpoint served through a real store.

No ranks: a thread plays the rank's work, a ``TCPStore`` here plays the ranks' store, and
``cluster.debug_line.DebugLine`` is the notebook's end of it, as in a lab.
"""

import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from labkit.cluster.debug_line import DebugLine
from labkit.rank.debugger import DebuggerQuit, RankDebugging, RankPdb

# The lab's own frames above the user's (the runtime's guard): made in a file of their own, which is left out.
OWN_FILE = "<the lab's guard>"
_guard: dict = {}
exec(compile("def guarded(work):\n    return work()\n", OWN_FILE, "exec"), _guard)


def inner(value):
    secret = value + 1  # noqa: F841 - read by the debugger
    raise ValueError(f"boom {value}")


def outer():
    outer_only = "outside"  # noqa: F841 - read by the debugger
    inner(41)


def failure() -> BaseException:
    try:
        _guard["guarded"](outer)
    except ValueError as error:
        return error
    raise AssertionError("outer() did not raise")


def debugging(store=None, rank=1) -> RankDebugging:
    return RankDebugging(SimpleNamespace(rank=rank, store=store), lambda: {OWN_FILE})


def test_post_mortem_prints_locals_walks_the_stack_and_leaves_the_labs_frames_out():
    rank = debugging()
    assert rank.open_post_mortem() is None  # nothing failed yet
    rank.remember(failure())
    opened = rank.open_post_mortem()
    assert opened["error"] == "ValueError: boom 41"
    assert "inner()" in opened["text"] and 'raise ValueError(f"boom {value}")' in opened["text"]
    assert rank.post_mortem_command("p secret") == {"text": "42\n", "ended": False}
    where = rank.post_mortem_command("w")["text"]
    assert "outer()" in where and "inner()" in where and OWN_FILE not in where and "failure()" not in where
    assert "*** Oldest frame" not in rank.post_mortem_command("up")["text"]
    assert rank.post_mortem_command("p outer_only")["text"] == "'outside'\n"
    assert "*** Oldest frame" in rank.post_mortem_command("up")["text"]  # the guard's frame is not there to go to
    assert rank.post_mortem_command("down")["text"].count("inner()") == 1
    assert rank.post_mortem_command("pp {'a': secret}")["text"] == "{'a': 42}\n"
    assert rank.post_mortem_command("p secret ;; p value")["text"] == "42\n41\n"
    assert "interact reads the rank's own terminal" in rank.post_mortem_command("interact")["text"]
    assert "NameError" in rank.post_mortem_command("p missing")["text"]
    assert rank.post_mortem_command("q") == {"text": "", "ended": True}
    assert rank.post_mortem_command("p secret")["ended"]  # the session is closed; the failure is kept
    assert rank.open_post_mortem() is not None


def test_a_stepping_command_ends_a_post_mortem_as_it_ends_pdbs():
    rank = debugging()
    rank.remember(failure())
    rank.open_post_mortem()
    assert rank.post_mortem_command("n")["ended"]


def test_a_rank_pdb_says_how_a_command_lets_the_code_go_on():
    debugger = RankPdb()
    debugger.reset()
    debugger.botframe = sys._getframe()
    assert debugger.command("c") and debugger.resumes == "continue"
    sys.settrace(None)


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield master


def run_in_thread(work):
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = work()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def stop_of(line: DebugLine, rank: int, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stop = line.stop_of(rank)
        if stop is not None:
            return stop
        time.sleep(0.005)
    raise AssertionError(f"rank {rank} did not stop within {seconds} s")


def test_a_breakpoint_stops_the_thread_answers_through_the_store_and_goes_on(store):
    rank = debugging(store)

    def work():
        local = 6 * 7
        rank.breakpoint()
        local += 1
        return local

    thread, outcome = run_in_thread(work)
    line = DebugLine((store.host, store.port))
    stop = stop_of(line, 1)
    assert stop["where"]["text"] == "local += 1" and "-> local += 1" in stop["text"]
    assert rank.stopped["stop"] == stop["stop"]  # what the whereabouts thread publishes
    began = time.perf_counter()
    answer = line.command(1, stop["stop"], "p local", lambda: None)
    assert time.perf_counter() - began < 1.0
    assert answer["text"] == "42\n" and answer["resumes"] is None
    assert line.command(1, stop["stop"], "n", lambda: None)["resumes"] == "step"
    stepped = stop_of(line, 1)
    assert stepped["stop"] != stop["stop"] and stepped["where"]["text"] == "return local"
    assert line.command(1, stepped["stop"], "p local", lambda: None)["text"] == "43\n"
    assert line.command(1, stepped["stop"], "c", lambda: None)["resumes"] == "continue"
    thread.join(10)
    assert outcome == {"value": 43} and rank.stopped is None and line.stop_of(1) is None
    assert sys.gettrace() is None


def test_q_at_a_breakpoint_raises_debugger_quit_in_the_users_frame(store):
    rank = debugging(store, rank=0)

    def work():
        rank.set_trace()
        return "went on"

    thread, outcome = run_in_thread(work)
    line = DebugLine((store.host, store.port))
    stop = stop_of(line, 0)
    assert line.command(0, stop["stop"], "q", lambda: None)["resumes"] == "quit"
    thread.join(10)
    assert isinstance(outcome["error"], DebuggerQuit)
    said = str(outcome["error"])
    assert said.startswith("the debugger quit (q) at line ") and '(`return "went on"`)' in said, said


def test_a_rank_whose_store_went_quits_on_its_own(store, monkeypatch):
    monkeypatch.setattr("labkit.rank.debugger.DEBUG_GIVE_UP_SECONDS", 0.3)
    rank = debugging(SimpleNamespace(host="127.0.0.1", port=1))  # nothing listens there

    def work():
        rank.breakpoint()

    thread, outcome = run_in_thread(work)
    thread.join(10)
    assert isinstance(outcome["error"], DebuggerQuit) and "could not reach this rank" in str(outcome["error"])
