"""pdb on a rank, driven from the notebook: after a failure (post-mortem) and at ``breakpoint()``.

Runs in the engines. A rank has no terminal: its stdin belongs to the engine, and
what it prints travels to the notebook only as the output of a request. So pdb is
driven one command at a time: ``RankPdb`` is a ``pdb.Pdb`` whose stdout is a
buffer, and ``command(line)`` runs one line (aliases and ``;;`` as pdb reads
them) and the notebook is sent what it printed. The notebook reads the lines
with ``input()`` (``runs.debugging``), so the same prompt works wherever
``input()`` does.

Post-mortem (``%lab debug``): ``_failed`` in the runtime keeps the last exception
of user work (``remember``), as Python keeps ``sys.last_value``; the notebook
opens a session on its traceback and sends commands through ipyparallel, which
can reach the engine because the rank is idle. The frames are kept alive until
the next failure, as Python's are.

Breakpoints: while the rank runs, ``sys.breakpointhook`` and ``pdb.set_trace``
are this rank's (installed once, when the rank is made: a rank process is the
lab's, and stdin-bound pdb can only hang there). The rank's thread then stops in
the caller's frame, but ipyparallel cannot deliver anything to that engine: its
main thread is the one that stopped. So the commands travel through the ranks'
rendezvous store (served by rank 0's C++ thread, which needs no Python thread of
any rank): the stopped thread writes where it stopped under ``DEBUG_STOP_KEY``
(the whereabouts thread also publishes it, which is how the notebook's wait loop
notices), then polls ``DEBUG_COMMAND_KEY`` and answers under ``DEBUG_ANSWER_KEY``.
A poll of 10 ms keeps a command's round trip short and costs a stopped rank
nothing it needs. ``c`` and the stepping commands return to the code; ``q``
raises ``DebuggerQuit`` (a ``bdb.BdbQuit``) in the user's frame, which the
runtime reports like any error, so the notebook ends the cell and rebuilds the
groups as after any failure. pdb's own loop catches ``KeyboardInterrupt`` and
prompts again; this one lets it through, so the lab's interrupt still ends a
stopped rank. When the store cannot be reached for ``DEBUG_GIVE_UP_SECONDS`` (rank 0
ended) the rank quits on its own instead of waiting for a prompt that cannot come.
"""

from __future__ import annotations

import bdb
import io
import itertools
import json
import os
import pdb
import sys
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from labkit.wire.store_client import store_client
from labkit.wire.store_keys import DEBUG_ANSWER_KEY, DEBUG_COMMAND_KEY, DEBUG_GIVE_UP_SECONDS, DEBUG_STOP_KEY

POLL_SECONDS = 0.01
STORE_TIMEOUT_SECONDS = 2.0
# Commands that read the rank's own stdin, which nobody can type into: refused with a way around.
NO_TERMINAL = {"interact": "p, pp or !statement", "debug": "p or !statement", "commands": "c to the next breakpoint"}
# Stepping never stops in the lab's plumbing around the user's code (pdb's skip: module names, as globs).
PLUMBING = ("labkit.rank.runtime", "labkit.rank.script", "labkit.rank.debugger", "labkit.wire.*", "ipyparallel.*",
            "ipykernel.*", "IPython.*")
# In a post-mortem session the work has ended: these leave the session, as they leave pdb.post_mortem.
LEAVES_POST_MORTEM = frozenset({"c", "cont", "continue", "q", "quit", "exit", "n", "next", "s", "step", "r",
                                "return", "unt", "until", "run", "restart", "EOF"})


class DebuggerQuit(bdb.BdbQuit):
    """``q`` at a rank's breakpoint: the rank's work ends here."""


class RankPdb(pdb.Pdb):
    """pdb with its output in a buffer, one command per call, and the lab's own frames left out of the stack."""

    def __init__(self, own_files: frozenset[str] = frozenset()) -> None:
        self.output = io.StringIO()
        # nosigint: pdb would otherwise make SIGINT break into the debugger, where the lab means to interrupt.
        super().__init__(stdout=self.output, skip=PLUMBING, nosigint=True, readrc=False)
        self.prompt = ""
        self.own_files = own_files
        self.serve: Callable[[RankPdb], None] | None = None  # at a breakpoint: where commands come from

    def take_output(self) -> str:
        """What was printed since the last call."""
        text = self.output.getvalue()
        self.output.seek(0)
        self.output.truncate()
        return text

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> Any:
        stop = super().setup(f, tb)
        # The stack starts below the lab's last frame (the runtime's guard, the entry points, and what ran them).
        own = [index for index, (frame, _) in enumerate(self.stack[:self.curindex])
               if frame.f_code.co_filename in self.own_files]
        if own:
            cut = own[-1] + 1
            self.stack, self.curindex = self.stack[cut:], self.curindex - cut
        return stop

    def command(self, line: str) -> bool:
        """Run one line as typed at pdb's prompt; True when the rank's code goes on (or quits)."""
        name = self.parseline(line)[0] or ""
        if name in NO_TERMINAL:
            self.error(f"{name} reads the rank's own terminal, which nothing can type into; use {NO_TERMINAL[name]}")
            return False
        stop = False
        self.cmdqueue.append(line)
        while self.cmdqueue and not stop:
            typed = self.precmd(self.cmdqueue.pop(0))
            stop = bool(self.postcmd(self.onecmd(typed), typed))
        self.cmdqueue.clear()
        return stop

    def _cmdloop(self) -> None:
        # Reached from interaction() at a breakpoint: commands come from the notebook, and a KeyboardInterrupt
        # (the lab's interrupt) ends the work instead of prompting again, as pdb's loop would.
        if self.serve is None:
            self.set_continue()
            return
        self.serve(self)

    @property
    def resumes(self) -> str:
        """How the code goes on after a command that returned to it: 'quit', 'continue' or 'step'."""
        if self.quitting:
            return "quit"
        return "continue" if self.stoplineno == -1 else "step"


def where(frame: FrameType) -> dict:
    """The file, line and text of ``frame``'s line, as ``rank.whereabouts`` says them."""
    import linecache

    filename, line = frame.f_code.co_filename, frame.f_lineno
    return {"file": filename, "line": line, "text": linecache.getline(filename, line).strip()}


class RankDebugging:
    """One rank's debugger: its last failure (post-mortem) and its breakpoints (``breakpoint()``)."""

    def __init__(self, runtime, own_files: Callable[[], set[str]]) -> None:
        self.runtime = runtime
        self._own_files = own_files
        self.last_failure: BaseException | None = None
        self.post_mortem: RankPdb | None = None
        self.stopped: dict | None = None  # where this rank's thread sits at a breakpoint (rank.whereabouts says it)
        self._stops = itertools.count(1)
        self._client = None
        self._client_of: tuple[str, int] | None = None

    @classmethod
    def installed(cls, runtime, own_files: Callable[[], set[str]]) -> RankDebugging:
        """A rank's debugger, with ``breakpoint()`` and ``pdb.set_trace()`` stopping in it from now on."""
        debugging = cls(runtime, own_files)
        sys.breakpointhook = debugging.breakpoint
        pdb.set_trace = debugging.set_trace
        return debugging

    def own_files(self) -> frozenset[str]:
        return frozenset({*self._own_files(), __file__})

    # -- post-mortem ------------------------------------------------------------

    def remember(self, error: BaseException) -> None:
        """The last exception of user work (``RankRuntime._failed``): ``%lab debug`` opens it."""
        self.last_failure = error
        self.post_mortem = None

    def open_post_mortem(self) -> dict | None:
        """Start a session on the last failure: its exception and where it stopped; None: nothing to debug."""
        error = self.last_failure
        if error is None or error.__traceback__ is None:
            return None
        debugger = RankPdb(self.own_files())
        debugger.reset()
        debugger.setup(None, error.__traceback__)
        debugger.print_stack_entry(debugger.stack[debugger.curindex])
        self.post_mortem = debugger
        return {"error": f"{type(error).__name__}: {error}", "text": debugger.take_output()}

    def post_mortem_command(self, line: str) -> dict:
        """One command of the post-mortem session: what it printed, and whether the session ended."""
        debugger = self.post_mortem
        if debugger is None:
            return {"text": "*** no post-mortem session is open on this rank\n", "ended": True}
        name = debugger.parseline(line.partition(";;")[0])[0] or ""
        if name in LEAVES_POST_MORTEM:  # the work ended: nothing runs on, the session ends
            self.post_mortem = None
            return {"text": "", "ended": True}
        debugger.command(line)
        return {"text": debugger.take_output(), "ended": False}

    def close_post_mortem(self) -> None:
        self.post_mortem = None

    # -- breakpoints --------------------------------------------------------------

    def breakpoint(self, *args, **kwargs) -> None:
        """``sys.breakpointhook``: stop in the caller's frame."""
        self.stop_in(sys._getframe(1))

    def set_trace(self, *, header: str | None = None) -> None:
        """``pdb.set_trace``: the same, with pdb's optional header shown at the prompt."""
        self.stop_in(sys._getframe(1), header)

    def stop_in(self, frame: FrameType, header: str | None = None) -> None:
        if self.stopped is not None:  # code a command runs at the prompt reached breakpoint() again
            print("breakpoint() while this rank is already at the prompt: ignored", flush=True)
            return
        if self.runtime.store is None:
            print(f"breakpoint() on rank {self.runtime.rank}: this rank has no process group, so no prompt can "
                  "reach it; going on", flush=True)
            return
        debugger = RankPdb(self.own_files())
        debugger.serve = lambda stopped: self._serve(stopped, header)
        debugger.set_trace(frame)

    def _serve(self, debugger: RankPdb, header: str | None) -> None:
        """At a breakpoint: publish where, answer the notebook's commands until one goes on."""
        rank = self.runtime.rank
        stop_key, command_key, answer_key = (key.format(rank=rank) for key in
                                             (DEBUG_STOP_KEY, DEBUG_COMMAND_KEY, DEBUG_ANSWER_KEY))
        stop_id = f"{os.getpid()}-{next(self._stops)}"
        frame = debugger.curframe
        assert frame is not None
        text = (header + "\n" if header else "") + debugger.take_output()
        self.stopped = {"stop": stop_id, "where": where(frame), "text": text, "since": time.time()}
        unreachable_since: float | None = None
        published = False
        try:
            while True:
                try:
                    client = self._connected()
                    if not published:
                        client.delete_key(command_key)  # a command left for a stop before this one
                        client.set(stop_key, json.dumps(self.stopped))
                        published = True
                    request = json.loads(client.get(command_key)) if client.check([command_key]) else None
                    unreachable_since = None
                except (RuntimeError, OSError, ValueError) as error:  # torch's DistError is a RuntimeError
                    self._client = None
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > DEBUG_GIVE_UP_SECONDS:
                        sys.settrace(None)
                        raise DebuggerQuit(f"the debugger quit: the notebook's prompt could not reach this rank for "
                                           f"{DEBUG_GIVE_UP_SECONDS:g} s (the ranks' store: {error})") from None
                    time.sleep(POLL_SECONDS * 10)
                    continue
                if request is None:
                    time.sleep(POLL_SECONDS)
                    continue
                client.delete_key(command_key)
                if request.get("stop") != stop_id:
                    continue  # meant for a stop of before
                goes_on = debugger.command(request["line"])
                if goes_on:
                    client.delete_key(stop_key)  # before the answer: the notebook never reads this stop again
                answer = {"stop": stop_id, "seq": request.get("seq"), "text": debugger.take_output(),
                          "resumes": debugger.resumes if goes_on else None}
                client.set(answer_key, json.dumps(answer))
                if goes_on:
                    break
        finally:
            self.stopped = None
        if debugger.quitting:
            sys.settrace(None)
            place = self.stopped_text(frame)
            raise DebuggerQuit(f"the debugger quit (q) {place}")

    @staticmethod
    def stopped_text(frame: FrameType) -> str:
        line = where(frame)
        text = f"at line {line['line']}" + (f" (`{line['text']}`)" if line["text"] else "")
        return text if line["file"].startswith("<") else f"{text} of {line['file']}"

    def _connected(self):
        """A store client of this rank's own for the prompt (the runtime's may be busy in another call)."""
        store = self.runtime.store
        if store is None:
            raise RuntimeError("this rank has no process group store")
        address = (store.host, store.port)
        if self._client is None or self._client_of != address:
            self._client = None
            self._client = store_client(*address, STORE_TIMEOUT_SECONDS)
            self._client_of = address
        return self._client
