"""``%lab`` and ``%%lab``: thin notebook wrappers over ``labkit.Lab``.

    %load_ext labkit
    %lab start 4              start 4 ranks (gloo on CPU; nccl, one per GPU, with CUDA)
    %lab mesh dp=2 tp=2       build a named device mesh on every rank and draw it
    %lab train --strategy fsdp --model gpt --steps 50 [--verify] [--dashboard]
                              train a zoo model under a strategy (see Lab.train)
    %lab slow 2 30ms          make rank 2 a straggler (off to undo)
    %lab link 100Mbit 20ms    a simulated slow network between the ranks (off to undo; alone: show it)
    %lab seed 42 [--same]     seed every rank: 42 + rank (or 42 everywhere)
    %lab run train.py --epochs 2   run a torchrun-style script, unmodified, on every rank
    %lab bench allreduce      time a collective over message sizes
    %%lab [--ranks 0,2] [--timeout 30]
    ...                       run the cell on every rank (or the given ones)
    %lab status               one row per rank
    %lab timeout 60           default time limit for each cell, in seconds
    %lab restart | stop       fresh processes | stop everything

Each magic parses its words and calls one method of the ``Lab`` it holds; the
``Lab`` is also put in the notebook as ``lab`` for the Python API.
"""

from __future__ import annotations

import argparse
import shlex
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from labkit.lab import Lab
from labkit.network_magics import add_network_arguments, join_command_line, network_settings
from labkit.queue_magics import ensemble_command, tasks_command
from labkit.runs.link import link_command
from labkit.spec.mesh import MeshSpec
from labkit.strategies.catalog import CATALOG, settings_by_name
from labkit.units import parse_duration, positive_seconds, power_of_two_range


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as IPython usage errors instead of exiting."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _seconds(text: str) -> float:
    try:
        return positive_seconds("a time limit", float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks are written 0,2,3; got {text!r}") from None


def _settings(text: str) -> dict:
    """``dim=128,layers=8`` -> {"dim": 128, "layers": 8} (integers where they are integers)."""
    settings = {}
    for word in text.replace(" ", ",").split(","):
        if not word:
            continue
        name, equals, value = word.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"write settings as name=value, got {word!r}")
        settings[name] = int(value) if value.lstrip("-").isdigit() else value
    return settings


def _size_range(text: str) -> list[int]:
    """``1KB:16MB`` -> every power of two from 1 KiB to 16 MiB (see ``labkit.units``)."""
    try:
        return power_of_two_range(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _duration(text: str) -> float | None:
    """``30ms`` -> 0.03, ``0.5s`` or ``0.5`` -> 0.5, ``off`` -> None."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _train_parser():
    """``%lab train``'s options: only the ones given reach ``Lab.train``, whose defaults apply.

    Each strategy's own settings come from the catalog, so a new strategy brings its options."""
    train = _Parser(prog="%lab train", add_help=False, argument_default=argparse.SUPPRESS)
    train.add_argument("--strategy", help=f"{', '.join(CATALOG)} or a composition like fsdp+tp")
    train.add_argument("--model", choices=("mlp", "gpt"))
    train.add_argument("--steps", type=int)
    train.add_argument("--resume", action="store_true", help="continue the last run from where it stopped")
    train.add_argument("--mesh", help="axis sizes for a composition, e.g. dp=2,tp=2")
    train.add_argument("--batch", type=int, dest="global_batch", help="global batch (samples per step)")
    train.add_argument("--micro-batches", type=int,
                       help="accumulation steps; pipeline microbatches (default: the number of stages under pp, else 1)")
    train.add_argument("--lr", type=float)
    train.add_argument("--optimizer", choices=("adamw", "sgd"))
    train.add_argument("--seed", type=int)
    train.add_argument("--max-memory", help="per-rank budget for params + grads + optimizer state, e.g. 64MB")
    train.add_argument("--verify", action="store_true", help="compare with single-process training")
    train.add_argument("--precision", choices=("fp32", "bf16"),
                       help="bf16: autocast (FSDP: its mixed-precision policy); fp32 keeps the equivalence proof")
    train.add_argument("--tf32", action="store_true", help="TensorFloat-32 matrix products on NVIDIA GPUs")
    train.add_argument("--peak-tflops", type=float, help="one device's peak TFLOP/s for MFU, where the lab has none")
    train.add_argument("--log-every", type=int)
    train.add_argument("--model-settings", type=_settings, help="e.g. dim=128,layers=8")
    train.add_argument("--timeout", type=_seconds)
    train.add_argument("--dashboard", action="store_true",
                       help="draw it live and train in the background (Stop button; the cell returns the run)")
    train.add_argument("--straggler-threshold", type=float)
    for name, (owner, setting) in settings_by_name().items():
        described = f"{owner}: {setting.help} (default {setting.default})"
        if isinstance(setting.default, bool):
            action = "store_false" if setting.default else "store_true"
            train.add_argument(setting.option, dest=name, action=action, help=described)
        else:
            train.add_argument(setting.option, dest=name, type=type(setting.default),
                               choices=setting.choices or None, help=described)
    return train


def _build_parsers():
    start = _Parser(prog="%lab start", add_help=False)
    start.add_argument("ranks", nargs="?", type=int, default=4)
    start.add_argument("--backend", choices=("gloo", "nccl"))
    start.add_argument("--timeout", type=_seconds, help="default limit for each cell, seconds")
    start.add_argument("--start-timeout", type=_seconds, help="limit for the ranks to come up, seconds")
    start.add_argument("--threads", type=int, help="torch threads per rank")
    start.add_argument("--check-collectives", action="store_true",
                       help="compare every collective across ranks first; a mismatch names each rank's call")
    start.add_argument("--oversubscribe", action="store_true",
                       help="start more ranks than this machine's memory and cores are judged to hold")
    add_network_arguments(start)
    train = _train_parser()
    bench = _Parser(prog="%lab bench", add_help=False)
    bench.add_argument("operation", choices=("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                                             "reducescatter", "broadcast"))
    bench.add_argument("--sizes", type=_size_range, help="e.g. 1KB:16MB (powers of two between)")
    bench.add_argument("--iters", type=int, help="repetitions per size (default: more for small sizes)")
    cell = _Parser(prog="%%lab", add_help=False)
    cell.add_argument("--ranks", type=_rank_list, help="run on these ranks only, e.g. 0,2")
    cell.add_argument("--timeout", type=_seconds, help="limit for this cell, seconds")
    return start, train, bench, cell


@magics_class
class LabMagics(Magics):
    """Holds this notebook's lab; every magic delegates to it."""

    def __init__(self, shell):
        super().__init__(shell)
        self.lab: Lab | None = None
        self._start_parser, self._train_parser, self._bench_parser, self._cell_parser = _build_parsers()

    # -- dispatch -------------------------------------------------------------

    @line_cell_magic
    def lab(self, line: str, cell: str | None = None):
        """Start, shape and use live torch.distributed ranks. See ``labkit.magics``.

        %lab start [N] [--backend gloo|nccl] [--timeout S] [--start-timeout S] [--threads K]
        %lab mesh name=size [name=size ...]     (one size may be -1)
        %lab train --strategy fsdp --model gpt --steps 50 [--mesh dp=2,tp=2] [--verify] [--max-memory 64MB]
            [--precision bf16] [--tf32] [--peak-tflops T]
            [--dashboard]   (live dashboard, runs in the background; returns the run)
        %lab slow RANK 30ms | %lab slow RANK off      (a straggler on demand)
        %lab link [100Mbit] [20ms] | %lab link off | %lab link   (a simulated slow network; alone: show it)
        %lab seed S [--same]    seed torch, numpy, random on every rank: S + rank (S everywhere with --same)
        %lab run [--ranks 0,2] [--timeout S] script.py [args ...]   a torchrun-style script as __main__
        %lab bench allreduce|all_gather|reduce_scatter|broadcast [--sizes 1KB:16MB] [--iters N]
        %lab checkpoint save|load PATH   save or load the ranks' training state (torch.distributed.checkpoint)
        %lab kill RANK | %lab heal      SIGKILL a rank; replace what died and go on from the last checkpoint
        %lab tasks FN ITEMS [--timeout S]   FN(item) for each item, on whichever rank is idle
        %lab ensemble [--model gpt] [--members 4] [--vary seed|lr] [--combine mean|vote]
        %lab start N --launcher mpi|ssh|slurm [--launcher-option K=V] [--controller-address A] [--encrypt]
        %lab join-command      the line that makes another machine's engine join as the next rank
        %lab status | %lab timeout S | %lab restart | %lab stop
        %%lab [--ranks 0,2] [--timeout S]       run the cell on the ranks
        """
        if cell is not None:
            return self._run_cell(line, cell)
        words = shlex.split(line)
        if not words:
            return self.status("")
        command, rest = words[0], words[1:]
        handlers = {
            "start": self.start,
            "mesh": self.mesh,
            "status": self.status,
            "stop": self.stop,
            "restart": self.restart,
            "timeout": self.timeout,
            "train": self.train,
            "slow": self.slow,
            "link": lambda words: link_command(self._require_lab(), words),
            "seed": self.seed,
            "run": self.run_script,
            "bench": self.bench,
            "checkpoint": self.checkpoint,
            "kill": self.kill,
            "heal": self.heal,
            "join-command": lambda words: join_command_line(self._require_lab()),
            "tasks": lambda words: tasks_command(self._require_lab(), words, self.shell.user_ns),
            "ensemble": lambda words: ensemble_command(self._require_lab(), words),
        }
        if command not in handlers:
            raise UsageError(f"unknown %lab command {command!r}; use one of: {', '.join(handlers)}")
        return handlers[command](rest)

    def _require_lab(self) -> Lab:
        if self.lab is None or not self.lab.running:
            raise UsageError("no lab is running: start one with %lab start 4")
        return self.lab

    def _publish(self, lab: Lab) -> None:
        namespace = self.shell.user_ns
        if not isinstance(namespace.get("lab"), (Lab, type(None))):
            return  # the notebook uses the name `lab` for something else: leave it alone
        namespace["lab"] = lab

    # -- commands ---------------------------------------------------------

    def start(self, words):
        options = self._start_parser.parse_args(words)
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

    def train(self, words):
        lab = self._require_lab()
        options = vars(self._train_parser.parse_args(words))
        mesh_text = options.pop("mesh", None)
        mesh = None
        if mesh_text:
            spec = MeshSpec.parse(mesh_text, lab.world_size)
            mesh = dict(zip(spec.names, spec.shape))
        live = options.pop("dashboard", False)
        return lab.train(mesh=mesh, dashboard=live, background=live, **options)

    def checkpoint(self, words):
        lab = self._require_lab()
        if len(words) != 2 or words[0] not in ("save", "load"):
            raise UsageError("write %lab checkpoint save PATH or %lab checkpoint load PATH")
        if words[0] == "save":
            print(f"saved to {lab.save(words[1])}")
            return None
        lab.load(words[1])
        return None

    def kill(self, words):
        lab = self._require_lab()
        if len(words) != 1 or not words[0].isdigit():
            raise UsageError("say which rank, e.g. %lab kill 1")
        print(lab.kill(int(words[0])))
        return None

    def heal(self, words):
        if words:
            raise UsageError("%lab heal takes no arguments")
        return self._require_lab().heal()

    def slow(self, words):
        lab = self._require_lab()
        if len(words) != 2:
            raise UsageError("say which rank and how much slower, e.g. %lab slow 2 30ms (or %lab slow 2 off)")
        try:
            rank = int(words[0])
        except ValueError:
            raise UsageError(f"the rank is a number, got {words[0]!r}") from None
        print(lab.slow(rank, _duration(words[1])))
        return None

    def seed(self, words):
        lab = self._require_lab()
        same = "--same" in words
        values = [word for word in words if word != "--same"]
        if len(values) != 1 or not values[0].isdigit():
            raise UsageError("give one seed, a non-negative integer, e.g. %lab seed 42 (or %lab seed 42 --same)")
        seeds = lab.seed(int(values[0]), same=same)
        print(f"seeded torch, numpy and random on every rank: {'the same seed ' + str(seeds[0]) if same else seeds}")
        return None

    def run_script(self, words):
        lab = self._require_lab()
        options = {"--ranks": None, "--timeout": None}
        while words and words[0] in options:  # options stand before the script; the rest is its own
            if len(words) < 2:
                raise UsageError(f"{words[0]} needs a value, e.g. %lab run --ranks 0,2 train.py")
            options[words[0]], words = words[1], words[2:]
        if not words:
            raise UsageError("give the script, e.g. %lab run train.py --epochs 2")
        try:
            ranks = _rank_list(options["--ranks"]) if options["--ranks"] else None
            timeout = _seconds(options["--timeout"]) if options["--timeout"] else None
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise UsageError(f"%lab run: {error}") from None
        lab.run_script(words[0], *words[1:], ranks=ranks, timeout=timeout)
        return None

    def bench(self, words):
        lab = self._require_lab()
        options = self._bench_parser.parse_args(words)
        return lab.bench_collective(options.operation, sizes=options.sizes, iterations=options.iters)

    def mesh(self, words) -> MeshSpec:
        lab = self._require_lab()
        spec = MeshSpec.parse(" ".join(words), lab.world_size)
        return lab.mesh(**dict(zip(spec.names, spec.shape)))

    def status(self, words):
        if self.lab is None:
            print("no lab yet: start one with %lab start 4")
            return None
        return self.lab.status()

    def stop(self, words):
        if self.lab is None or not self.lab.running:
            print("no lab is running")
            return None
        self.lab.stop()
        print("lab stopped: no rank, controller or port left")
        return None

    def restart(self, words):
        lab = self._require_lab()
        began = time.monotonic()
        lab.restart()
        print(f"{lab.plan.describe()}: restarted in {time.monotonic() - began:.1f} s")
        return None

    def timeout(self, words):
        lab = self._require_lab()
        if len(words) != 1:
            raise UsageError("give the limit in seconds, e.g. %lab timeout 60")
        try:
            lab.timeout = _seconds(words[0])
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise UsageError(f"%lab timeout: {error}") from None
        print(f"each cell may now run for {lab.timeout:g} s")
        return None

    # -- cells ------------------------------------------------------------

    def _run_cell(self, line: str, cell: str):
        lab = self._require_lab()
        options = self._cell_parser.parse_args(shlex.split(line))
        lab.run_cell(cell, ranks=options.ranks, timeout=options.timeout, show_values=True)
        return None

    # -- extension lifecycle ---------------------------------------------------

    def close(self) -> None:
        if self.lab is not None:
            self.lab.stop()
