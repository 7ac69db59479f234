"""``%lab`` and ``%%lab``: thin notebook wrappers over ``labkit.Lab``.

Each magic parses its words and calls one method of the ``Lab`` it holds; the
``Lab`` is also put in the notebook as ``lab`` for the Python API. The words are
read before the lab is looked for, so a mistake is answered whether one runs or not.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from labkit.lab import Lab
from labkit.magics.auto import AutoMode
from labkit.magics.commands import CELL
from labkit.magics.completion import add_rank_matcher, remove_rank_matcher
from labkit.magics.help import BARE, described_parsers, overview
from labkit.magics.link import link_command
from labkit.magics.network import join_command_line, join_parser, network_settings
from labkit.magics.parsers import bench_parser, cell_parser, push_parser, start_parser, who_parser
from labkit.magics.parsing import HELP_WORDS, CommandParser, HelpShown, asks_for_help, unknown_word
from labkit.magics.queue import ensemble_command, ensemble_parser, tasks_command, tasks_parser
from labkit.magics.train_args import notebook_values, train_parser
from labkit.magics.values import duration, rank_list, run_own_words, seconds, split_run_words
from labkit.spec.mesh import MeshSpec
from labkit.views.rank_blocks import rank_label

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

# Commands whose parser reads their words (the others' parsers only describe them, for --help).
_OWN_PARSERS: dict[str, Callable[[], CommandParser]] = {
    "start": start_parser, "train": train_parser, "bench": bench_parser, "push": push_parser, CELL: cell_parser,
    "join-command": join_parser, "who": who_parser}


@magics_class
class LabMagics(Magics):
    """Holds this notebook's lab; every magic delegates to it."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self._shell = shell  # also IPython's ``self.shell``, which its type leaves optional
        self.lab: Lab | None = None
        self._parsers: dict[str, CommandParser] = {}
        self._auto = AutoMode(shell)  # %lab auto: every cell that follows runs on the ranks until %lab auto off
        self._rank_matcher = add_rank_matcher(shell, self)  # Tab in the ranks' code completes from their names

    def _parser(self, command: str) -> CommandParser:
        """``command``'s parser (``CELL`` for ``%%lab``), made on first use and kept: train's lists every
        installed strategy's settings, and reading the plugins' declarations at %load_ext would slow it down."""
        if command == "tasks":
            return tasks_parser()
        if command == "ensemble":
            return ensemble_parser()
        if command not in self._parsers:
            make = _OWN_PARSERS.get(command)
            # The others only describe commands read by hand, for their --help: made together.
            self._parsers.update({command: make()} if make is not None else described_parsers())
        return self._parsers[command]

    # -- dispatch -------------------------------------------------------------

    # The method has its own name: ``self.lab`` is the lab this object holds. IPython types its decorator
    # factory as the union of its two uses (bare and named), so the named use needs the ignore.
    @line_cell_magic("lab")  # type: ignore[arg-type]
    def lab_magic(self, line: str, cell: str | None = None) -> Any:
        """Start, shape and use live torch.distributed ranks. See ``labkit.magics``.

        %lab start [N] [--backend gloo|nccl] [--timeout S] [--start-timeout S] [--threads K]
        %lab mesh name=size [name=size ...]     (one size may be -1)
        %lab train --strategy fsdp --model gpt --steps 50 [--mesh dp=2,tp=2] [--verify] [--max-memory 64MB]
            [--precision bf16] [--tf32] [--peak-tflops T]
            [--dashboard]   (live dashboard, runs in the background; returns the run)
        %lab train --model MyNet --data train_set [--loss my_loss] [--pp-split blocks.4] [--tp-plan plan]
            (your own model, data and loss: names the notebook defines)
        %lab slow RANK 30ms | %lab slow RANK off      (a straggler on demand)
        %lab link [100Mbit] [20ms] | %lab link off | %lab link   (a simulated slow network; alone: show it)
        %lab seed S [--same]    seed torch, numpy, random on every rank: S + rank (S everywhere with --same)
        %lab push NAME [NAME ...] [--ranks 0,2]   the notebook's functions, classes, modules, values onto the ranks
        %lab run [--ranks 0,2] [--timeout S] [--dashboard] script.py [args ...]   a torchrun-style script as __main__
        %lab bench allreduce|all_gather|reduce_scatter|broadcast [--sizes 1KB:16MB] [--iters N]
        %lab checkpoint save|load PATH   save or load the ranks' training state (torch.distributed.checkpoint)
        %lab kill RANK | %lab heal      SIGKILL a rank; replace what died and go on from the last checkpoint
        %lab debug [RANK]   pdb on a rank's last exception (default: the first rank that raised); see lab.debug
        %lab tasks FN ITEMS [--timeout S]   FN(item) for each item, on whichever rank is idle
        %lab ensemble [--model gpt] [--members 4] [--vary seed|lr] [--combine mean|vote]
        %lab start N --launcher mpi|ssh|slurm [--launcher-option K=V] [--controller-address A] [--encrypt]
        %lab join-command [--https]   the line that makes another machine join: as the next rank, or as a site
        %lab sites      the machines that joined over HTTPS (sites): their engines and line
        %lab status | %lab timeout S | %lab restart | %lab stop
        %lab who [--ranks 0,2]   the ranks' variables: type, shape, dtype, device, parameters; where ranks differ
        %lab auto [off]   every following cell runs on the ranks (a cell starting with a magic runs here)
        %%lab [--ranks 0,2] [--site NAME] [--timeout S] [--dashboard] [--view tabs|grid]   run the cell on the ranks
        %lab --help | %lab COMMAND --help      every command in one line | one command's options
        """
        if cell is not None:
            if asks_for_help(shlex.split(line)):  # help only: the cell does not run
                self._parser(CELL).print_help()
                return None
            return self._run_cell(line, cell)
        words = shlex.split(line)
        if not words:
            return self.status([])
        command, rest = words[0], words[1:]
        if command in HELP_WORDS:
            print(overview(), end="")
            return None
        handlers: dict[str, Callable[[list[str]], Any]] = {  # in the order of %lab --help
            "start": self.start,
            "mesh": self.mesh,
            "train": self.train,
            "slow": self.slow,
            "link": lambda words: link_command(self._require_lab(), words),
            "seed": self.seed,
            "push": self.push,
            "run": self.run_script,
            "bench": self.bench,
            "checkpoint": self.checkpoint,
            "kill": self.kill,
            "heal": self.heal,
            "debug": self.debug,
            "tasks": lambda words: tasks_command(self._require_lab, words, self._shell.user_ns),
            "ensemble": lambda words: ensemble_command(self._require_lab, words),
            "join-command": lambda words: join_command_line(self._require_lab(),
                                                            self._parser("join-command").parse_args(words)),
            "sites": lambda words: print(self._require_lab().sites),
            "status": self.status,
            "who": self.who,
            "auto": self.auto_command,
            "timeout": self.timeout,
            "restart": self.restart,
            "stop": self.stop,
        }
        if command not in handlers:
            said = unknown_word("command", command, handlers)
            said += " The commands: " if said.endswith("?") else "; the commands: "
            raise UsageError(f"{said}{', '.join(handlers)} (see %lab --help)")
        # %lab run's words after the script are the script's own: its --help is the script's.
        own = run_own_words(rest) if command == "run" else rest
        if asks_for_help(own):
            self._parser(command).print_help()
            return None
        if command in BARE and rest:  # a word after a command that takes none is a mistake, not to be ignored
            raise UsageError(f"%lab {command} takes no arguments, got {' '.join(rest)!r}: write %lab {command}")
        try:
            return handlers[command](rest)
        except HelpShown:  # a parser printed its help
            return None

    @property
    def auto(self) -> bool:
        """Whether every cell runs on the ranks (``%lab auto``)."""
        return self._auto.on

    @auto.setter
    def auto(self, on: bool) -> None:
        self._auto.set(on)

    def auto_command(self, words: list[str]) -> None:
        if len(words) > 1 or (words and words[0] not in ("on", "off")):
            raise UsageError("write %lab auto (or %lab auto on) to run every cell on the ranks, %lab auto off to stop")
        on = not words or words[0] == "on"
        if on:
            self._require_lab()
        self.auto = on
        print("every cell now runs on the ranks, as %%lab; a cell starting with a magic (%lab auto off) runs here"
              if on else "cells run in the notebook again")

    def _require_lab(self) -> Lab:
        if self.lab is None or not self.lab.running:
            raise UsageError("no lab is running: start one with %lab start 4")
        return self.lab

    def _publish(self, lab: Lab) -> None:
        namespace = self._shell.user_ns
        if not isinstance(namespace.get("lab"), (Lab, type(None))):
            return  # the notebook uses the name `lab` for something else: leave it alone
        namespace["lab"] = lab

    # -- commands ---------------------------------------------------------

    def start(self, words: list[str]) -> None:
        options = self._parser("start").parse_args(words)
        wanted = dict(ranks=options.ranks, backend=options.backend, threads_per_rank=options.threads,
                      oversubscribe=options.oversubscribe, check_collectives=options.check_collectives,
                      **network_settings(options))
        settings = {
            key: value
            for key, value in (("timeout", options.timeout), ("start_timeout", options.start_timeout))
            if value is not None
        }
        candidate = Lab(**wanted, **settings)  # validates before anything starts
        current = self.lab
        if current is not None and current.running and (current.plan, current.launcher) == (candidate.plan,
                                                                                     candidate.launcher):
            for key, value in settings.items():
                setattr(current, key, value)
            if current.status().healthy:
                print(f"lab already running ({current.plan.describe()}); reusing it")
                self._publish(current)
                return None
        if current is not None and current.running:
            current.stop()
            print(f"stopped the previous lab ({current.plan.describe()})")
        began = time.monotonic()
        candidate.start()
        self.lab = candidate
        self._publish(candidate)
        print(
            f"{candidate.plan.describe()}: ready in {time.monotonic() - began:.1f} s "
            f"(process group generation {candidate.generation})"
        )
        return None

    def train(self, words: list[str]) -> Any:
        options = vars(self._parser("train").parse_args(words))  # mistakes first, lab or not
        try:
            options = notebook_values(options, self._shell.user_ns)
        except ValueError as error:
            raise UsageError(str(error)) from None
        lab = self._require_lab()
        mesh_text = options.pop("mesh", None)
        mesh = None
        if mesh_text:
            spec = MeshSpec.parse(mesh_text, lab.world_size)
            mesh = dict(zip(spec.names, spec.shape))
        live = options.pop("dashboard", False)
        return lab.train(mesh=mesh, dashboard=live, background=live, **options)

    def checkpoint(self, words: list[str]) -> None:
        lab = self._require_lab()
        if len(words) != 2 or words[0] not in ("save", "load"):
            raise UsageError("write %lab checkpoint save PATH or %lab checkpoint load PATH")
        if words[0] == "save":
            print(f"saved to {lab.save(words[1])}")
            return None
        lab.load(words[1])
        return None

    def kill(self, words: list[str]) -> None:
        lab = self._require_lab()
        if len(words) != 1 or not words[0].isdigit():
            raise UsageError("say which rank, e.g. %lab kill 1")
        print(lab.kill(int(words[0])))
        return None

    def heal(self, words: list[str]) -> Any:
        return self._require_lab().heal()

    def debug(self, words: list[str]) -> None:
        if len(words) > 1 or (words and not words[0].isdigit()):
            raise UsageError("say which rank, e.g. %lab debug 1 (alone: the first rank that raised in the last "
                             "failed work)")
        self._require_lab().debug(int(words[0]) if words else None)
        return None

    def slow(self, words: list[str]) -> None:
        lab = self._require_lab()
        if len(words) != 2:
            raise UsageError("say which rank and how much slower, e.g. %lab slow 2 30ms (or %lab slow 2 off)")
        try:
            rank = int(words[0])
        except ValueError:
            raise UsageError(f"the rank is a number, got {words[0]!r}") from None
        print(lab.slow(rank, duration(words[1])))
        return None

    def seed(self, words: list[str]) -> None:
        lab = self._require_lab()
        same = "--same" in words
        values = [word for word in words if word != "--same"]
        if len(values) != 1 or not values[0].isdigit():
            raise UsageError("give one seed, a non-negative integer, e.g. %lab seed 42 (or %lab seed 42 --same)")
        seeds = lab.seed(int(values[0]), same=same)
        print(f"seeded torch, numpy and random on every rank: {'the same seed ' + str(seeds[0]) if same else seeds}")
        return None

    def push(self, words: list[str]) -> None:
        options = self._parser("push").parse_args(words)
        namespace = self._shell.user_ns
        missing = [name for name in options.names if name not in namespace]
        if missing:  # a mistake first, lab or not
            known = [name for name in namespace if not name.startswith("_")]
            said = [name + "".join(f" (did you mean {close}?)" for close in difflib.get_close_matches(name, known, n=1))
                    for name in missing]
            raise UsageError(f"%lab push takes names defined in the notebook; not defined: {', '.join(said)}")
        self._require_lab().push({name: namespace[name] for name in options.names}, ranks=options.ranks)
        return None

    def run_script(self, words: list[str]) -> Any:
        lab = self._require_lab()
        options, words = split_run_words(words)
        if not words:
            raise UsageError("give the script, e.g. %lab run train.py --epochs 2")
        ranks_text, timeout_text = options["--ranks"], options["--timeout"]
        try:
            ranks = rank_list(ranks_text) if ranks_text else None
            timeout = seconds(timeout_text) if timeout_text else None
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise UsageError(f"%lab run: {error}") from None
        watched = {flag: bool(options[f"--{flag}"]) for flag in ("instruments", "dashboard", "background")}
        # Watched: the report (or the run in the background) is the cell's value, as lab.train's is.
        return lab.run_script(words[0], *words[1:], ranks=ranks, timeout=timeout, **watched)

    def bench(self, words: list[str]) -> Any:
        options = self._parser("bench").parse_args(words)
        lab = self._require_lab()
        return lab.bench_collective(options.operation, sizes=options.sizes, iterations=options.iters)

    def mesh(self, words: list[str]) -> MeshSpec:
        lab = self._require_lab()
        spec = MeshSpec.parse(" ".join(words), lab.world_size)
        return lab.mesh(**dict(zip(spec.names, spec.shape)))

    def status(self, words: list[str]) -> Any:
        if self.lab is None:
            print("no lab yet: start one with %lab start 4")
            return None
        return self.lab.status()

    def who(self, words: list[str]) -> Any:
        options = self._parser("who").parse_args(words)  # mistakes first, lab or not
        return self._require_lab().who(ranks=options.ranks)

    def stop(self, words: list[str]) -> None:
        if self.lab is None or not self.lab.running:
            print("no lab is running")
            return None
        self.lab.stop()
        print("lab stopped: no rank, controller or port left")
        return None

    def restart(self, words: list[str]) -> None:
        lab = self._require_lab()
        began = time.monotonic()
        lab.restart()
        print(f"{lab.plan.describe()}: restarted in {time.monotonic() - began:.1f} s")
        return None

    def timeout(self, words: list[str]) -> None:
        lab = self._require_lab()
        if len(words) != 1:
            raise UsageError("give the limit in seconds, e.g. %lab timeout 60")
        try:
            lab.timeout = seconds(words[0])
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise UsageError(f"%lab timeout: {error}") from None
        print(f"each cell may now run for {lab.timeout:g} s")
        return None

    # -- cells ------------------------------------------------------------

    def _run_cell(self, line: str, cell: str) -> Any:
        options = self._parser(CELL).parse_args(shlex.split(line))
        if options.auto and (self.lab is None or not self.lab.running):
            raise UsageError("no lab is running, and %lab auto sends every cell to the ranks: start one with "
                             "%lab start 4, or run cells here again with %lab auto off")
        lab = self._require_lab() if options.site is None else self._require_lab().site(options.site)
        watched = dict(instruments=options.instruments, dashboard=options.dashboard, background=options.background)
        if options.auto:  # a reader of the saved notebook sees where the cell ran
            ranks = options.ranks if options.ranks is not None else range(lab.world_size)
            print(f"%lab auto: on {rank_label(list(ranks))[1:-1]}")
        value = lab.run_cell(cell, ranks=options.ranks, timeout=options.timeout, show_values=True,
                             cell=self._shell.execution_count, view=options.view, **watched)
        return value if any(watched.values()) else None

    # -- extension lifecycle ---------------------------------------------------

    def close(self) -> None:
        remove_rank_matcher(self._shell, self._rank_matcher)
        self.auto = False
        if self.lab is not None:
            self.lab.stop()
