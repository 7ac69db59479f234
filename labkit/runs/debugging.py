"""pdb on the ranks, typed in the notebook: post-mortem (``%lab debug``) and the prompt of ``breakpoint()``.

The rank side (``rank.debugger``) runs one pdb command per request and sends back
what it printed; this side reads the lines and prints the answers. Lines are read
with Python's ``input()``, looked up when each line is read: JupyterLab, Jupyter
Notebook and a terminal IPython all give ``input()`` a line, so the one prompt
works in each. Where nothing can be typed (nbclient raises
``StdinNotImplementedError``, a closed stdin ``EOFError``) the debugger says so in
one line, with what works instead, and ends as pdb does at the end of its input:
it quits. ``lab.debug(rank, commands=[...])`` gives the lines instead, for scripts.

Post-mortem: the rank is idle, so each command is an ordinary ipyparallel request
(``entry.debug_command``). Without a rank, the first rank that raised in the last
failed work (``Session.last_failure``) is opened.

Breakpoints: a stopped rank's engine takes no requests (its main thread is in the
debugger), so commands travel through the ranks' store (``cluster.debug_line``).
``BreakpointDesk`` belongs to one ``RankWork``: its wait loop calls ``serve``,
which, when the whereabouts say ranks stopped, reads each stop from the store and
serves one rank at a time (``rank N`` switches; ``c`` lets it go on, and the next
stopped rank is served; ``q`` ends the work: every stopped rank quits, ranks waiting
in a collective are released by the deadlock watch as after any rank that stopped
with an error, and the groups are rebuilt in place as after any failure). The time
spent at the prompt is added to the work's deadline. Before each line, the other
ranks' liveness is checked, so a rank that died or froze meanwhile is named at once.
While ranks are stopped the live note says so instead of naming their peers' wait
as a hang (``live_note``); the deadlock rules never count a stopped rank, which waits
in no collective.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from labkit.cluster.debug_line import DebugLine
from labkit.runs.deadlock import describe_line, waiting_note, waits_of
from labkit.spec.errors import LabConfigError, LabError, format_ranks
from labkit.wire import entry
from labkit.wire.schema import FailureKind
from labkit.wire.store_keys import DEBUG_GIVE_UP_SECONDS

if TYPE_CHECKING:
    from labkit.runs.dispatch import RankWork
    from labkit.session import Session

COMMAND_SECONDS = 60.0  # one post-mortem command (``p`` of a large value takes its time)
STEP_WAIT_SECONDS = 1.0  # after n or s: how long the prompt waits for the rank to stop again before the work goes on
HELP = "c goes on, q ends the cell on every rank"


class NoInput(Exception):
    """No line can be read: ``error`` is why (None: the given lines ran out)."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__(str(error))
        self.error = error


LineReader = Callable[[str], str]


def line_reader(commands: Iterable[str] | None = None) -> LineReader:
    """What reads the debugger's next line: ``input()``, or ``commands`` one by one (each shown after its
    prompt, as typed), then ``NoInput(None)``."""
    if commands is not None:
        queue = list(commands)

        def given(prompt: str) -> str:
            if not queue:
                raise NoInput(None)
            line = queue.pop(0)
            print(f"{prompt}{line}", flush=True)
            return line

        return given

    def typed(prompt: str) -> str:
        from IPython.core.error import StdinNotImplementedError

        try:
            return builtins.input(prompt)  # looked up now: a front end (or a test) may have replaced it
        except (EOFError, OSError, StdinNotImplementedError) as error:  # OSError: a stdin captured or closed
            raise NoInput(error) from None

    return typed


def no_input_line(error: BaseException, instead: str) -> str:
    """The one line said where nothing can be typed."""
    return (f"labkit: the debugger cannot read a line here ({type(error).__name__}: this front end gives no input, "
            f"as nbclient, nbconvert and papermill do not); {instead}")


# -- post-mortem ----------------------------------------------------------------------------


def chosen_rank(session: Session, rank: int | None) -> int:
    """``rank``, checked; None: the first rank that raised in the last failed work."""
    session.require_running()
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise LabConfigError(f"rank is one rank number, got {rank!r}")
        return session.targets(rank)[0]
    failure = session.last_failure
    if failure is None:
        raise LabConfigError("no work has failed on this lab: there is nothing to debug (%lab debug RANK opens the "
                             "last exception of that rank)")
    raised = sorted(failure.raised) or [r for r in failure.failed_ranks if r not in failure.died]
    if not raised:
        raise LabConfigError("in the last failed work no rank raised an exception it still holds (the ranks that "
                             "failed died): there is nothing to debug")
    return raised[0]


def post_mortem(session: Session, rank: int | None = None, commands: Iterable[str] | None = None) -> None:
    """A pdb session on ``rank``'s last exception, its lines read by ``input()`` (or taken from ``commands``)."""
    chosen = chosen_rank(session, rank)
    opened = session.call([chosen], entry.debug_open, (), COMMAND_SECONDS)[0]
    if opened is None:
        raise LabError(f"rank {chosen} has nothing to debug: no work of it has failed since it started")
    print(f"labkit: rank {chosen}'s last exception, {opened['error']} (pdb: p, pp, l, w, up, down; q leaves)")
    print(opened["text"], end="", flush=True)
    read = line_reader(commands)
    try:
        while True:
            try:
                line = read(f"(rank {chosen} pdb) ")
            except NoInput as missing:
                if missing.error is not None:
                    instead = ("debug in JupyterLab, Jupyter Notebook or a terminal IPython, or give the lines: "
                               f"lab.debug({chosen}, commands=['w', 'p x'])")
                    print(no_input_line(missing.error, instead))
                return
            answer = session.call([chosen], entry.debug_command, (line,), COMMAND_SECONDS)[0]
            print(answer["text"], end="", flush=True)
            if answer["ended"]:
                return
    finally:
        try:
            session.call([chosen], entry.debug_close, (), COMMAND_SECONDS)
        except LabError:  # it went meanwhile: nothing is left open
            pass


# -- breakpoints ---------------------------------------------------------------------------


def live_note(states: dict, now: float, prompted: bool = False) -> str:
    """The line under a running cell: ranks stopped at a breakpoint first (unless ``prompted``: the prompt says
    it), then the longest wait in a collective."""
    waiting = waiting_note(states, now)
    stopped = sorted(rank for rank, state in states.items() if state.get("stopped"))
    if not stopped or prompted:
        return waiting
    first = states[stopped[0]]["stopped"]
    said = (f"rank {stopped[0]} stopped at a breakpoint {describe_line(first.get('where'))}" if len(stopped) == 1
            else f"{format_ranks(stopped)} stopped at breakpoints")
    return said + (f"; {waiting}" if waiting else "")


class BreakpointDesk:
    """The prompt for the ranks of one piece of work that stop at ``breakpoint()`` (see the module's docstring)."""

    def __init__(self, work: RankWork, check_alive: Callable[[], None], read: LineReader | None = None) -> None:
        """``check_alive``: the work's own liveness check (ends a frozen rank, reports a dead one)."""
        self.work = work
        self.check_alive = check_alive
        self.read = read or line_reader()
        self.quitting = False  # q was typed (or nothing can be): every rank that stops quits
        self.current: int | None = None  # the rank the prompt serves
        self.unreachable = False  # the store stopped answering: the stopped ranks quit on their own
        self._line: DebugLine | None = None
        self._told: set[int] = set()  # ranks already said to have died
        self._warned = False  # that peers waiting in a collective fail at the limit

    @property
    def prompts(self) -> bool:
        """Whether stopped ranks get a prompt now (not past the limit, nor in a run in the background)."""
        work = self.work
        return not (work.store_address is None or work.timed_out or work.interrupted or self.unreachable
                    or threading.current_thread() is not threading.main_thread())

    def note(self, states: dict, now: float) -> str:
        """The live line under the work (``live_note``)."""
        return live_note(states, now, prompted=self.prompts)

    def serve(self) -> float:
        """Serve the ranks stopped now until none is; the seconds it took (not counted against the work's limit)."""
        work = self.work
        address = work.store_address
        if address is None or not self.prompts or not any(
                state.get("stopped") and rank in work.pending for rank, state in work.whereabouts.items()):
            return 0.0
        began = time.monotonic()
        try:
            self._line = self._line or DebugLine(address)
            self._serve(self._line)
        except (RuntimeError, OSError) as error:  # the store (torch's DistError is a RuntimeError)
            self.unreachable = True
            if not self._name_the_dead({}):
                why = "rank 0, which serves it, ended" if 0 in self._told else str(error).splitlines()[0]
                print(f"labkit: the prompt can no longer reach the stopped ranks: the ranks' store does not answer "
                      f"({why}); they quit on their own within {DEBUG_GIVE_UP_SECONDS:g} s", flush=True)
        return time.monotonic() - began

    def _serve(self, line: DebugLine) -> None:
        # Every rank of the work is asked, not only those the whereabouts (a moment old) say stopped.
        stops = {rank: stop for rank in sorted(self.work.pending) if (stop := line.stop_of(rank)) is not None}
        if not stops:
            return  # the whereabouts lag: these went on already
        if self.quitting:
            self._quit_all(line, stops)
            return
        current = self.current if self.current in stops else min(stops)
        self._announce(current, stops)
        self._warn_of_waits(stops)
        while stops:
            self.current = current
            if self._name_the_dead(stops):
                return
            if current not in stops:
                if not stops:
                    break
                current = min(stops)
                self._announce(current, stops)
                continue
            try:
                typed = self.read(f"(rank {current} pdb) ")
            except NoInput as missing:
                print(no_input_line(missing.error or EOFError(), f"the debugger quit on {format_ranks(sorted(stops))} "
                                    "and the cell ends; run it where you can type (JupyterLab, Jupyter Notebook, a "
                                    "terminal IPython), or take the breakpoint() out"), flush=True)
                self.quitting = True
                self._quit_all(line, stops)
                return
            words = typed.split()
            if words[:1] == ["rank"]:
                current = self._switch(words, current, stops, line)
                continue
            answer = line.command(current, stops[current]["stop"], typed, self._condition_of(current))
            if isinstance(answer, str):  # it died or froze at the prompt
                print(f"labkit: rank {current} {answer} while at the prompt", flush=True)
                del stops[current]
                self.check_alive()
                self._told.add(current)
                continue
            print(answer["text"], end="", flush=True)
            resumes = answer.get("resumes")
            if resumes is None:
                continue
            del stops[current]
            if resumes == "quit":
                self.quitting = True
                self._quit_all(line, stops)
                print(f"labkit: the debugger quit on rank {current}: the cell ends on every rank (ranks waiting for it "
                      "in a collective are released)", flush=True)
                return
            again = self._stopped_again(line, current) if resumes == "step" else None
            if again is not None:
                stops[current] = again
                print(again["text"], end="", flush=True)
                continue
            stops.update({rank: stop for rank in sorted(self.work.pending)
                          if rank not in stops and rank != current and (stop := line.stop_of(rank)) is not None})
            if stops:
                current = min(stops)
                self._announce(current, stops)
        self.current = None

    def _announce(self, rank: int, stops: dict[int, dict]) -> None:
        stop = stops[rank]
        others = sorted(set(stops) - {rank})
        also = f"; {format_ranks(others)} stopped too (rank N switches)" if others else ""
        print(f"labkit: rank {rank} stopped at a breakpoint {describe_line(stop.get('where'))}{also}; {HELP}",
              flush=True)
        print(stop.get("text", ""), end="", flush=True)

    def _warn_of_waits(self, stops: dict[int, dict]) -> None:
        """Once: the ranks that wait in a collective meanwhile fail at the work's limit, which gloo cannot extend."""
        now = time.monotonic()
        waiting = sorted(rank for rank, state in self.work.whereabouts.items()
                         if rank not in stops and rank in self.work.pending and waits_of(rank, state, now))
        if waiting and not self._warned:
            self._warned = True
            print(f"labkit: {format_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in a collective "
                  f"meanwhile, which fails {self.work.timeout:g} s after it began (the cell's limit: gloo fixes it "
                  "when the collective starts); go on before then, or give the cell a longer --timeout", flush=True)

    def _switch(self, words: list[str], current: int, stops: dict[int, dict], line: DebugLine) -> int:
        """``rank N``: serve rank N from now on, when it is stopped; ``rank`` alone: say which is served."""
        wanted = words[1] if len(words) == 2 else None
        if wanted is not None and wanted.isdigit() and int(wanted) in self.work.pending and int(wanted) not in stops:
            stop = line.stop_of(int(wanted))  # it may have stopped since the prompt came
            if stop is not None:
                stops[int(wanted)] = stop
        if wanted is None or not wanted.isdigit():
            print(f"labkit: the prompt serves rank {current}; stopped: {format_ranks(sorted(stops))} "
                  "(rank N switches)", flush=True)
            return current
        if int(wanted) not in stops:
            print(f"labkit: rank {wanted} is not stopped at a breakpoint; stopped: {format_ranks(sorted(stops))}",
                  flush=True)
            return current
        self._announce(int(wanted), stops)
        return int(wanted)

    def _stopped_again(self, line: DebugLine, rank: int) -> dict | None:
        """After a step: the rank's next stop, when it comes within ``STEP_WAIT_SECONDS``."""
        deadline = time.monotonic() + STEP_WAIT_SECONDS
        while time.monotonic() < deadline:
            stop = line.stop_of(rank)
            if stop is not None:
                return stop
            if self.work.cluster.condition(rank) is not None:
                return None
            time.sleep(0.01)
        return None

    def _quit_all(self, line: DebugLine, stops: dict[int, dict]) -> None:
        """Every rank of ``stops`` quits (its work ends with ``DebuggerQuit``)."""
        for rank, stop in sorted(stops.items()):
            line.command(rank, stop["stop"], "q", self._condition_of(rank))
        stops.clear()

    def _condition_of(self, rank: int) -> Callable[[], str | None]:
        """Why ``rank`` can no longer work, asked when called (None: it can)."""
        return lambda: self.work.cluster.condition(rank)

    def _name_the_dead(self, stops: dict[int, dict]) -> bool:
        """Check every rank of the work; say which died or froze since (a frozen one is ended). True when rank 0,
        which serves the ranks' store, is among them: no prompt can reach a stopped rank any more."""
        self.check_alive()
        for rank, report in sorted(self.work.reports.items()):
            error: dict = dict(report.get("error") or {})
            if error.get("kind") == FailureKind.DIED and rank not in self._told:
                self._told.add(rank)
                stops.pop(rank, None)
                print(f"labkit: rank {rank}: {error.get('message')}; its peers are released when they wait for it",
                      flush=True)
        if 0 in self._told and (stops or self.unreachable):
            self.unreachable = True
            ranks, quits = (format_ranks(sorted(stops)), "it quits on its own" if len(stops) == 1 else
                            "they quit on their own") if stops else ("the stopped ranks", "they quit on their own")
            print(f"labkit: rank 0 served the ranks' store, so the prompt can no longer reach {ranks}; {quits} within "
                  f"{DEBUG_GIVE_UP_SECONDS:g} s", flush=True)
            return True
        return False
