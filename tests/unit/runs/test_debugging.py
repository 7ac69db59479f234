"""The notebook's prompt for ranks stopped at breakpoint(), fed by a list, against threads that stop in this process.

Each "rank" is a thread whose work calls ``breakpoint()`` through a ``RankDebugging`` of its own;
a ``TCPStore`` here is the ranks' store. The prompt loop (``BreakpointDesk``) is the one a cell's
wait loop runs; its work is a stand-in with what the desk reads of a ``RankWork``.
"""

import builtins
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from IPython.core.error import StdinNotImplementedError

from labkit.rank.debugger import DebuggerQuit, RankDebugging
from labkit.runs.debugging import BreakpointDesk, NoInput, line_reader, live_note, no_input_line


def test_given_lines_are_shown_after_their_prompt_then_run_out(capsys):
    read = line_reader(["p x", "c"])
    assert read("(rank 1 pdb) ") == "p x" and read("(rank 1 pdb) ") == "c"
    with pytest.raises(NoInput) as ran_out:
        read("(rank 1 pdb) ")
    assert ran_out.value.error is None
    assert capsys.readouterr().out == "(rank 1 pdb) p x\n(rank 1 pdb) c\n"


@pytest.mark.parametrize("error", [EOFError(), StdinNotImplementedError("raw_input was called, but this frontend "
                                                                           "does not support input requests.")])
def test_input_that_cannot_be_read_is_no_input(monkeypatch, error):
    def no_line(prompt):
        raise error

    monkeypatch.setattr(builtins, "input", no_line)
    with pytest.raises(NoInput) as missing:
        line_reader()("(rank 0 pdb) ")
    assert missing.value.error is error
    said = no_input_line(error, "debug in JupyterLab")
    assert said == (f"labkit: the debugger cannot read a line here ({type(error).__name__}: this front end gives no "
                    "input, as nbclient, nbconvert and papermill do not); debug in JupyterLab")
    assert "\n" not in said


def test_input_is_looked_up_when_a_line_is_read(monkeypatch):
    read = line_reader()
    monkeypatch.setattr(builtins, "input", lambda prompt: f"typed at {prompt}")
    assert read("(rank 2 pdb) ") == "typed at (rank 2 pdb) "


def test_the_live_note_says_a_rank_stopped_at_a_breakpoint_before_any_wait():
    where = {"file": "<lab cell In[3]>", "line": 3, "text": "breakpoint()"}
    waiting = {"groups": {"world": {"ranks": [0, 1], "issued": 1, "collectives": 1, "waiting": 0,
                                    "in_flight": [[0, "all_reduce", 4, 100.0]]}},
               "where": {"file": "<lab cell In[3]>", "line": 4, "text": "dist.all_reduce(x)"}, "world": "world",
               "sampled": 105.0, "seen_at": 10.0}
    states = {0: waiting, 1: {"stopped": {"stop": "1-1", "where": where}, "groups": {}}}
    assert live_note(states, 10.0) == ("rank 1 stopped at a breakpoint at line 3 (`breakpoint()`); rank 0 waits in "
                                       "all_reduce on the world group at line 4 (`dist.all_reduce(x)`) for 5.0 s")
    states[0] = {"stopped": {"stop": "0-1", "where": where}, "groups": {}}
    assert live_note(states, 10.0) == "ranks 0, 1 stopped at breakpoints"
    assert live_note({}, 10.0) == ""


@pytest.fixture
def store():
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)


class Ranks:
    """Threads standing in for ranks, each stopping at a breakpoint in its work; and the work the desk reads."""

    def __init__(self, store, ranks):
        self.debuggers = {rank: RankDebugging(SimpleNamespace(rank=rank, store=store), set) for rank in ranks}
        self.outcomes: dict = {rank: {} for rank in ranks}
        self.threads = [threading.Thread(target=self._work, args=(rank,), daemon=True) for rank in ranks]
        self.work = SimpleNamespace(whereabouts={}, pending=dict.fromkeys(ranks),
                                    store_address=(store.host, store.port),
                                    timed_out=False, interrupted=False, reports={}, timeout=60.0,
                                    cluster=SimpleNamespace(condition=lambda rank: None))
        for thread in self.threads:
            thread.start()

    def _work(self, rank):
        try:
            local = 40 + rank
            self.debuggers[rank].breakpoint()
            self.outcomes[rank]["value"] = local + 100
        except BaseException as error:  # noqa: BLE001 - the test reads it
            self.outcomes[rank]["error"] = error

    def all_stopped(self, seconds=10.0):
        """Wait until every thread stopped; the whereabouts then say so, as a rank's thread publishes them."""
        deadline = time.monotonic() + seconds
        while any(debugger.stopped is None for debugger in self.debuggers.values()):
            assert time.monotonic() < deadline, "a rank did not stop"
            time.sleep(0.01)
        time.sleep(0.05)  # the stop is in the store just after it is set here
        self.work.whereabouts = {rank: {"stopped": d.stopped} for rank, d in self.debuggers.items()}

    def join(self):
        for thread in self.threads:
            thread.join(10)
            assert not thread.is_alive()


def test_the_prompt_serves_one_rank_switches_and_goes_on_with_each(store, capsys):
    ranks = Ranks(store, [0, 1])
    ranks.all_stopped()
    desk = BreakpointDesk(ranks.work, lambda: None,
                          line_reader(["p local", "rank 3", "rank 1", "p local", "c", "rank", "c"]))
    spent = desk.serve()
    ranks.join()
    assert ranks.outcomes == {0: {"value": 140}, 1: {"value": 141}}
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("labkit: rank 0 stopped at a breakpoint at line ")
    assert lines[0].endswith("; rank 1 stopped too (rank N switches); c goes on, q ends the cell on every rank")
    assert lines[1].startswith("> ") and lines[2] == '-> self.outcomes[rank]["value"] = local + 100'
    assert lines[3:8] == ["(rank 0 pdb) p local", "40", "(rank 0 pdb) rank 3",
                          "labkit: rank 3 is not stopped at a breakpoint; stopped: ranks 0, 1", "(rank 0 pdb) rank 1"]
    assert lines[8].startswith("labkit: rank 1 stopped at a breakpoint") and "rank 0 stopped too" in lines[8]
    assert lines[11:14] == ["(rank 1 pdb) p local", "41", "(rank 1 pdb) c"]
    assert lines[14].startswith("labkit: rank 0 stopped at a breakpoint") and "too" not in lines[14]
    assert lines[17:] == ["(rank 0 pdb) rank", "labkit: the prompt serves rank 0; stopped: rank 0 (rank N switches)",
                          "(rank 0 pdb) c"]
    assert spent > 0


def test_q_quits_every_stopped_rank(store, capsys):
    ranks = Ranks(store, [0, 1])
    ranks.all_stopped()
    desk = BreakpointDesk(ranks.work, lambda: None, line_reader(["q"]))
    desk.serve()
    ranks.join()
    assert all(isinstance(outcome["error"], DebuggerQuit) for outcome in ranks.outcomes.values())
    assert capsys.readouterr().out.splitlines()[-1] == ("labkit: the debugger quit on rank 0: the cell ends on every "
                                                        "rank (ranks waiting for it in a collective are released)")
    assert desk.quitting


def test_no_input_says_so_in_one_line_and_every_stopped_rank_quits(store, capsys):
    ranks = Ranks(store, [0, 1])
    ranks.all_stopped()

    def no_line(prompt):
        raise NoInput(StdinNotImplementedError("no input requests"))

    started = time.monotonic()
    BreakpointDesk(ranks.work, lambda: None, no_line).serve()
    ranks.join()
    assert time.monotonic() - started < 5
    assert all(isinstance(outcome["error"], DebuggerQuit) for outcome in ranks.outcomes.values())
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("labkit: the debugger cannot read a line here (StdinNotImplementedError: ")
    assert "the debugger quit on ranks 0, 1 and the cell ends" in said


def test_nothing_is_served_past_the_limit_or_when_no_rank_is_stopped(store):
    ranks = Ranks(store, [0])
    desk = BreakpointDesk(ranks.work, lambda: None, line_reader([]))
    assert desk.serve() == 0.0  # the whereabouts say nothing yet
    ranks.all_stopped()
    ranks.work.timed_out = True
    assert desk.serve() == 0.0
    ranks.work.timed_out = False
    BreakpointDesk(ranks.work, lambda: None, line_reader(["c"])).serve()
    ranks.join()
