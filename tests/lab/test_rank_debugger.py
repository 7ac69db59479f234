"""%lab debug and breakpoint() in %%lab cells, on a real 2-rank lab, typed through ``input()`` as a person would.

``builtins.input`` is replaced by a list of lines (a line may be a function, run when its prompt
comes, or an exception, raised there): the notebook's prompt reads each line with ``input()``.
"""

import builtins
import os
import signal
import time

import pytest
from IPython.core.error import StdinNotImplementedError, UsageError

from labkit import RankFailure
from labkit.spec.errors import LabConfigError, LabError
from tests.conftest import lab_shell

pytestmark = pytest.mark.lab

CELL_BOUND_SECONDS = 40  # every cell here ends well within it, whatever is typed


@pytest.fixture(scope="module")
def shell():
    with lab_shell("2 --backend gloo --threads 1 --timeout 60") as ip:
        yield ip


class Typed:
    """What ``input()`` returns, line by line; the prompts it was shown and when."""

    def __init__(self, monkeypatch, lines):
        self.lines = list(lines)
        self.prompts: list[str] = []
        self.asked_at: list[float] = []  # time.time() of each prompt
        self.answered_at: list[float] = []
        monkeypatch.setattr(builtins, "input", self)

    def __call__(self, prompt=""):
        self.prompts.append(prompt)
        self.asked_at.append(time.time())
        assert self.lines, f"no line left to type at {prompt!r}"
        line = self.lines.pop(0)
        if callable(line):
            line = line(prompt)
        if isinstance(line, BaseException):
            raise line
        self.answered_at.append(time.time())
        return line


def run_cell(shell, line, code):
    began = time.monotonic()
    try:
        return shell.run_cell_magic("lab", line, code)
    finally:
        assert time.monotonic() - began < CELL_BOUND_SECONDS


def failing_cell(shell):
    with pytest.raises(RankFailure, match="rank 1 raised ValueError: rank 1 fails"):
        run_cell(shell, "", "secret = 41 + rank\nif rank == 1:\n    raise ValueError('rank 1 fails')\n")


def test_post_mortem_on_a_rank_that_raised(shell, monkeypatch, capsys):
    with pytest.raises(LabConfigError, match="no work has failed on this lab"):
        shell.run_line_magic("lab", "debug")
    failing_cell(shell)
    capsys.readouterr()
    typed = Typed(monkeypatch, ["p secret", "w", "q"])
    shell.run_line_magic("lab", "debug 1")
    out = capsys.readouterr().out
    assert typed.prompts == ["(rank 1 pdb) "] * 3 and not typed.lines
    lines = out.splitlines()
    assert lines[0] == ("labkit: rank 1's last exception, ValueError: rank 1 fails (pdb: p, pp, l, w, up, down; "
                        "q leaves)")
    assert lines[1].startswith("> <lab cell In[") and lines[2] == "-> raise ValueError('rank 1 fails')"
    assert lines[3] == "42"
    # The stack is the cell's: none of the lab's own frames (runtime, entry points, ipyparallel) above it.
    assert [line for line in lines[4:] if line.startswith(("> ", "  "))] == [lines[1]]
    # Alone: the first rank that raised in the last failed work.
    Typed(monkeypatch, ["p rank, secret", "c"])
    shell.run_line_magic("lab", "debug")
    assert "(1, 42)" in capsys.readouterr().out.splitlines()


def test_post_mortem_refusals_are_one_line(shell, monkeypatch, capsys):
    failing_cell(shell)
    with pytest.raises(LabError, match="^rank 0 has nothing to debug: no work of it has failed since it started$"):
        shell.run_line_magic("lab", "debug 0")
    with pytest.raises(LabConfigError, match="between 0 and 1, got 5"):
        shell.run_line_magic("lab", "debug 5")
    with pytest.raises(UsageError, match="say which rank, e.g. %lab debug 1"):
        shell.run_line_magic("lab", "debug one")
    capsys.readouterr()
    Typed(monkeypatch, [StdinNotImplementedError("raw_input was called, but this frontend does not support input "
                                                 "requests.")])
    shell.run_line_magic("lab", "debug 1")
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("labkit: the debugger cannot read a line here (StdinNotImplementedError: this front end "
                           "gives no input")
    assert said.endswith("or give the lines: lab.debug(1, commands=['w', 'p x'])")
    # Scripted: the lines given, each after its prompt.
    shell.user_ns["lab"].debug(1, commands=["p secret + 1"])
    assert capsys.readouterr().out.splitlines()[-2:] == ["(rank 1 pdb) p secret + 1", "43"]


def test_a_breakpoint_on_one_rank_stops_there_and_c_finishes_the_cell(shell, monkeypatch, capsys):
    capsys.readouterr()
    typed = Typed(monkeypatch, ["p value", "p stopped_at", "c"])
    run_cell(shell, "--ranks 1", "import time\nvalue = 7 * rank\nstopped_at = time.time()\nbreakpoint()\n"
                                 "print('after', value)\ndone = True\n")
    out = capsys.readouterr().out
    lines = out.splitlines()
    lines = lines[next(index for index, line in enumerate(lines) if line.startswith("labkit: rank 1 stopped")):]
    assert lines[0] == ("labkit: rank 1 stopped at a breakpoint at line 6 (`print('after', value)`); c goes on, q ends "
                        "the cell on every rank")
    assert lines[2] == "-> print('after', value)"
    assert "7" in lines and "[rank 1] after 7" in lines
    assert typed.prompts == ["(rank 1 pdb) "] * 3
    stopped_at = float(lines[lines.index("7") + 1])
    print(f"\nbreakpoint() to prompt: {typed.asked_at[0] - stopped_at:.3f} s; one command's round trip: "
          f"{typed.asked_at[1] - typed.answered_at[0]:.3f} s")


def test_breakpoints_on_both_ranks_before_an_all_reduce(shell, monkeypatch, capsys):
    first: list[int] = []

    def switch(prompt):
        first.append(int(prompt.split()[1]))
        time.sleep(1.0)  # the other rank reaches its breakpoint meanwhile
        return f"rank {1 - first[0]}"

    capsys.readouterr()
    typed = Typed(monkeypatch, [switch, "p x.item()", "c", "p x.item()", "c"])
    run_cell(shell, "", "x = torch.ones(1) * (rank + 1)\nbreakpoint()\ndist.all_reduce(x)\nprint('sum', x.item())\n")
    out = capsys.readouterr().out.splitlines()
    a, b = first[0], 1 - first[0]
    assert typed.prompts == [f"(rank {a} pdb) ", f"(rank {b} pdb) ", f"(rank {b} pdb) ", f"(rank {a} pdb) ",
                             f"(rank {a} pdb) "]
    assert [line for line in out if line in ("1.0", "2.0")] == [f"{b + 1}.0", f"{a + 1}.0"]
    assert "[rank 0] sum 3.0" in out and "[rank 1] sum 3.0" in out
    assert any(line.startswith(f"labkit: rank {b} stopped at a breakpoint") and f"rank {a} stopped too" in line
               for line in out)


def test_a_peer_waiting_in_a_collective_is_said_to_fail_at_the_cells_limit(shell, monkeypatch, capsys):
    def later(prompt):
        time.sleep(1.0)  # rank 0 is in the all-reduce by now, and its whereabouts say so
        return "c"

    Typed(monkeypatch, [later, "c"])
    run_cell(shell, "--timeout 30", "x = torch.ones(1)\nif rank == 1:\n    import time; time.sleep(4); breakpoint()\n"
                                    "dist.all_reduce(x)\nprint('sum', x.item())\n")
    out = capsys.readouterr().out.splitlines()
    assert ("labkit: rank 0 waits in a collective meanwhile, which fails 30 s after it began (the cell's limit: gloo "
            "fixes it when the collective starts); go on before then, or give the cell a longer --timeout") in out
    assert {"[rank 0] sum 2.0", "[rank 1] sum 2.0"} <= set(out)


def test_q_ends_the_cell_on_every_rank_and_the_namespace_stays(shell, monkeypatch, capsys):
    run_cell(shell, "", "kept = 10 + rank\n")
    Typed(monkeypatch, ["q"])
    with pytest.raises(RankFailure) as failed:
        run_cell(shell, "", "x = torch.ones(1)\nif rank == 1:\n    breakpoint()\ndist.all_reduce(x)\nprint('done')\n")
    said = str(failed.value)
    assert said.startswith("rank 1 raised DebuggerQuit: the debugger quit (q) at line 5 (`dist.all_reduce(x)`)"), said
    assert "rank 0 failed in a collective as a consequence of rank 1" in said
    assert "rebuilt in place" in failed.value.recovery
    capsys.readouterr()
    run_cell(shell, "", "y = torch.ones(1)\ndist.all_reduce(y)\nprint(kept, y.item())\n")
    assert {"[rank 0] 10 2.0", "[rank 1] 11 2.0"} <= set(capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("error", [EOFError(), StdinNotImplementedError("no input requests")])
def test_no_input_at_a_breakpoint_says_so_and_ends_the_cell(shell, monkeypatch, capsys, error):
    Typed(monkeypatch, [error])
    with pytest.raises(RankFailure, match="DebuggerQuit"):
        run_cell(shell, "", "x = torch.ones(1)\nbreakpoint()\ndist.all_reduce(x)\n")
    said = [line for line in capsys.readouterr().out.splitlines() if "cannot read a line" in line]
    assert said and said[0].startswith(f"labkit: the debugger cannot read a line here ({type(error).__name__}: ")
    assert "the debugger quit on" in said[0]
    run_cell(shell, "", "print('next cell', rank)\n")
    assert "[rank 1] next cell 1" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("stopped, ended, how",
                         [(0, 1, signal.SIGSTOP), (0, 1, signal.SIGKILL), (1, 0, signal.SIGKILL)])
def test_a_peer_that_freezes_or_dies_while_a_rank_is_at_the_prompt_is_named(shell, monkeypatch, capsys, stopped, ended,
                                                                            how):
    lab = shell.user_ns["lab"]

    def end_the_other(prompt):
        os.kill(lab.cluster.pid_of[ended], how)
        time.sleep(0.5)
        return "p rank"

    Typed(monkeypatch, [end_the_other, "c"])
    with pytest.raises(RankFailure) as failed:
        run_cell(shell, "", f"x = torch.ones(1)\nif rank == {stopped}:\n    breakpoint()\ndist.all_reduce(x)\n")
    said = "froze (stopped by a signal) and was ended" if how == signal.SIGSTOP else "died"
    assert f"rank {ended} {said}" in str(failed.value)
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"labkit: rank {ended}: the rank's process") for line in out), out
    if ended == 0:  # it served the ranks' store: the stopped rank cannot be reached, and quits on its own
        assert f"rank {stopped} raised DebuggerQuit: the debugger quit: the notebook's prompt could not reach" in str(
            failed.value)
        assert any(line.startswith("labkit: rank 0 served the ranks' store, so the prompt can no longer reach ")
                   for line in out), out
    capsys.readouterr()
    run_cell(shell, "", "print('world', dist.get_world_size())\n")  # the ended rank was replaced; the lab works
    assert {"[rank 0] world 2", "[rank 1] world 2"} <= set(capsys.readouterr().out.splitlines())
