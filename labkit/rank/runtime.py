"""What lives inside each rank: its identity, its process group, its mesh, its runner.

This module runs in the engines, never in the notebook. ``install()`` is each
engine's startup command: it builds one ``RankRuntime`` and puts it, with the
names a cell expects (``rank``, ``world_size``, ``mesh``, ``device``, ``torch``,
``dist``), into the engine's user namespace. The notebook then reaches the
runtime through the small module-level functions below, which ipyparallel
pickles by reference.

The runtime's promise to the notebook: every piece of user work comes back as a
plain dict (ok, value, error with a trimmed traceback, and what each process group
has issued and left in flight) within its time limit. A failure leaves the process
groups as they are: the notebook decides from every rank's report whether a
collective was cut, and only then has the ranks release their peers and rebuild
the groups in place (``lab_groups``), so the objects built on them go on.
"""

from __future__ import annotations

import ast
import linecache
import os
import signal
import socket
import sys
import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from labkit.rank.context import RankContext
from labkit.rank.control import ControlChannel
from labkit.rank.debugger import RankDebugging
from labkit.rank.displays import RankDisplays
from labkit.rank.environment import (device_name, end_at_sigterm, process_group_backend, seed_as_asked,
                                     seed_independently, nccl_seconds, torchrun_environment)
from labkit.rank.failures import error_info
from labkit.rank.instruments.recorders import recorder_for
from labkit.rank.lab_groups import LabGroups
from labkit.rank.model_steps import ModelSteps
from labkit.rank.requests import RankRequests
from labkit.rank.user_process import UserProcess
from labkit.rank.whereabouts import Whereabouts
from labkit.spec.network import place_on_network
from labkit.torch_support.torch_internals import set_group_timeout
from labkit.wire import entry
from labkit.wire.current import RUNTIME_NAME
from labkit.wire.gpus import gpu_index, gpus_shown
from labkit.wire.rank_settings import RankSettings

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class RankRuntime(RankContext):
    """One lab rank: identity, process group generation, mesh, training state, the cells it runs."""

    def __init__(self, namespace: dict, settings: RankSettings) -> None:
        """``settings``: what the notebook decided for this rank (``cluster.placement.RankPlan.settings``)."""
        backend = settings["backend"]
        self.local_rank = settings["local_rank"]
        self.local_world_size = settings["local_world_size"]
        self.host_index = settings["host_index"]
        self.host_count = settings["host_count"]
        if backend == "nccl":
            # One GPU per rank, by the rule the notebook checked the placement against (and scripts use).
            device = torch.device("cuda", gpu_index(self.local_rank, gpus_shown()))
        else:
            device = torch.device("cpu")
        super().__init__(settings["rank"], backend, device)
        self.namespace = namespace
        self.world_size = settings["world_size"]
        self.interface, self.address = place_on_network(settings["controller_address"],
                                                         # a joined machine's own --interface first
                                                         os.environ.get("LABKIT_INTERFACE") or settings["interface"])
        # gloo and nccl open their data sockets on this interface only (read when a group forms).
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = self.interface
        self.controller_ports = frozenset(settings["controller_ports"])
        self.groups = LabGroups(process_group_backend(backend), device if backend == "nccl" else None, self.link,
                                keep_ports=self.controller_ports)
        self.mesh: DeviceMesh | None = None
        self.mesh_spec: tuple[tuple[int, ...], tuple[str, ...]] | None = None
        self.cells_run = 0
        self.user_process = UserProcess()  # the notebook's folder, umask and environment, for user work
        self.seeding: tuple[int, bool] | None = None  # what lab.seed last asked: (value, same)
        self.requests = RankRequests(self)  # the rank side of wire.entry's train, save, load, seed, push
        # What the engine loaded to become a rank: a script's folder never displaces these.
        self.lasting_modules = frozenset(name.partition(".")[0] for name in list(sys.modules))
        threads = settings["threads"]
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        seed_independently()  # forked ranks would otherwise share the host's random state
        end_at_sigterm()
        if settings["check_collectives"]:
            # torch checks every collective's kind, shapes and dtypes across ranks before running it
            # (one more small collective each) and names the ranks that differ.
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        # torch read TORCH_DISTRIBUTED_DEBUG when it was imported, before this rank's settings came: again.
        dist.set_debug_level_from_env()
        self._publish_names()
        from IPython import get_ipython

        self.displays = RankDisplays.for_shell(get_ipython())  # what work displays reaches the notebook, marked and bounded
        self.debugging = RankDebugging.installed(self, _own_files)  # post-mortem and breakpoint() for the notebook
        self.model_steps = ModelSteps()  # DDP and FSDP2 models, put back in step after failed work
        self.whereabouts = Whereabouts(self)  # while user work runs: its line and collectives, for the notebook
        self.whereabouts.start()

    # -- names a cell sees --------------------------------------------------

    def _publish_names(self) -> None:
        self.namespace.update(
            {
                RUNTIME_NAME: self,
                "rank": self.rank,
                "world_size": self.world_size,
                "device": self.device,
                "mesh": self.mesh,
                "torch": torch,
                "dist": dist,
                # IPython's exit would return and let the rest of the cell run: end the cell's code instead.
                "exit": sys.exit,
                "quit": sys.exit,
            }
        )

    def identity(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "address": self.address,
            "interface": self.interface,
            "local_rank": self.local_rank,
            "backend": self.backend,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "generation": self.generation,
            "group_ready": dist.is_initialized(),
            "mesh": None if self.mesh_spec is None else [list(s) for s in self.mesh_spec],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_name": device_name(self.device),
        }

    # -- process group ------------------------------------------------------

    def open_store(self, timeout_seconds: float) -> tuple[str, int]:
        """Rank 0: serve a fresh rendezvous store on this rank's lab address; (address, port).

        TCPStore binds every interface when it opens its own socket, so the
        socket is opened here, bound to the lab's address only, and handed over.
        """
        self.store = None  # the previous generation's server closes here
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.address, 0))
        listener.listen(max(128, self.world_size * 4))
        port = listener.getsockname()[1]
        self.store = dist.TCPStore(
            self.address,
            port,
            self.world_size,
            True,
            timeout=timedelta(seconds=timeout_seconds),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )
        return self.address, port

    def join_group(self, place: dict, generation: int, timeout_seconds: float, reason: str = "") -> int:
        """Form the world of generation ``generation``: every group of before is retired with ``reason``.

        ``place``: this rank's number and the world's size now (they change when the
        lab grows or shrinks) and the store's address and port."""
        self.leave_group(reason or f"the lab's ranks changed (generation {generation})")
        self.renumber(int(place["rank"]), int(place["world_size"]))
        host, port = place["store_host"], int(place["store_port"])
        if self.rank != 0 or self.store is None:
            self.store = dist.TCPStore(host, port, self.world_size, False, timeout=timedelta(seconds=timeout_seconds))
        self.groups.form(self.store, generation, self.rank, self.world_size, timedelta(seconds=timeout_seconds))
        self.generation = self.formation = generation
        # What torchrun would have set; the rendezvous address changes with every generation.
        os.environ.update(torchrun_environment(self.rank, self.world_size, host, port, local_rank=self.local_rank,
                                               local_world_size=self.local_world_size,
                                               host_index=self.host_index, host_count=self.host_count))
        return self.generation

    def rebuild_groups(self, generation: int, timeout_seconds: float) -> int:
        """Same ranks, same world: every group gets its generation-``generation`` self, in place; how many.

        Everything built on the groups (DDP, FSDP, DTensors, meshes, the training state) goes on
        (the models' per-iteration state is put in step by ``put_models_in_step``)."""
        count = self.groups.reconfigure(generation, timedelta(seconds=timeout_seconds))
        self.generation = generation
        return count

    def put_models_in_step(self, failed_here: bool) -> list[str]:
        """After work that failed on some rank: every DDP and FSDP2 model of this rank put as every rank puts
        its own (``rank.model_steps``); ``failed_here``: this rank ran that work. What was done, per model."""
        return self.model_steps.put_in_step(failed_here)

    def release_collectives(self) -> int:
        """Close this rank's group connections: peers waiting for it in a collective fail now."""
        return self.groups.release()

    def renumber(self, rank: int, world_size: int) -> None:
        """This process is rank ``rank`` of ``world_size`` from now on (the lab grew or shrank)."""
        if (rank, world_size) == (self.rank, self.world_size):
            return
        if rank != self.rank:
            self.recorder = recorder_for(rank, self.device)
        self.rank, self.world_size = rank, world_size
        self._publish_names()

    def leave_group(self, reason: str = "the lab stopped") -> None:
        """Retire every process group (handles built on them fail with ``reason``) and the meshes."""
        self.mesh = None
        self.forget_group()
        self.namespace["mesh"] = None
        self.groups.retire(reason)

    def set_collective_timeout(self, seconds: float) -> None:
        """Bound every collective of every group by ``seconds`` (the cell's limit); nccl's more loosely.

        A gloo collective past its limit raises in the cell. nccl's watchdog instead ends the whole
        process, so nccl keeps a limit past the lab's own path (interrupt, then release or replace
        the rank: ``runs.dispatch``): it only fires if that path failed."""
        if not dist.is_initialized():
            return
        limit, nccl_limit = timedelta(seconds=seconds), timedelta(seconds=nccl_seconds(seconds))
        with warnings.catch_warnings():
            # check_collectives wraps groups in torch's checker, which has no knob: they keep the
            # limit they were made with (start_timeout), and torch would warn at every cell.
            warnings.simplefilter("ignore", UserWarning)
            for handle in list(self.groups.handles):
                if handle.inner is None:
                    continue
                try:
                    set_group_timeout(handle.inner, limit, nccl_limit)
                except Exception:  # groups of backends without the knob keep theirs
                    pass

    # -- mesh -----------------------------------------------------------------

    def build_mesh(self, shape: list[int], names: list[str]) -> tuple[int, ...]:
        """The notebook's mesh: built on every rank, available to cells as ``mesh``; this rank's coordinate."""
        mesh: DeviceMesh = self.mesh_for(shape, names)
        self.mesh = mesh
        self.mesh_spec = (tuple(shape), tuple(names))
        self.namespace["mesh"] = mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # the notebook's mesh spans every rank
        return tuple(coordinate)

    # -- running user work ------------------------------------------------------

    def run_cell(self, code: str, cell: int | None, timeout_seconds: float, watch: dict | None = None) -> dict:
        """Run a cell's code in this rank's namespace; the last expression is shown.

        ``cell``: the notebook's execution count when ``code`` is a ``%%lab`` cell's body. Tracebacks
        then name the cell as its prompt does and count lines as the editor does (the ``%%lab``
        line is line 1); code given to ``lab.run_cell`` is named by its call on this rank. ``watch``: instruments
        on the loop it runs, as for a script (``run_script``)."""
        self.cells_run += 1
        if cell is None:
            filename = f"<lab.run_cell {self.cells_run}>"
        else:
            filename = f"<lab cell In[{cell}]>"
            code = "\n" + code  # the %%lab line: line numbers are the editor's, syntax errors' too
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)

        rich: list[dict] = []  # the last value's richer forms than its repr, when it has any

        def body():
            tree = ast.parse(code, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), self.namespace)
                if value is None:
                    return None
                shown = self.displays.rich(value)
                if shown:
                    rich.append(shown)
                return repr(value)
            return None

        # A watched loop has its own stop at a step boundary; a plain cell stops before a DDP iteration.
        report = self._guarded(self._watched(body, watch), timeout_seconds, result_key="display",
                               stop_before_iteration=watch is None)
        if rich and report.get("ok") and watch is None:
            report["rich"] = rich[0]
        return report

    def call(self, fn, args, kwargs, sources: dict | None, timeout_seconds: float) -> dict:
        """Call ``fn``; ``sources`` (filename -> lines) lets tracebacks show notebook-defined code."""
        for filename, lines in (sources or {}).items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        return self._guarded(lambda: fn(*args, **kwargs), timeout_seconds, result_key="value")

    def run_script(self, source: str, path: str, argv: list[str], timeout_seconds: float,
                   watch: dict | None = None) -> dict:
        """Run a torchrun-style script as ``__main__`` (see ``labkit.rank.script``), as in a fresh process:
        its random state drawn afresh (or seeded as ``lab.seed`` asked), its groups destroyed at its end.

        ``watch``: instruments on its loop (``{"stoppable": bool}``, see ``instruments.loop_watch``); the
        value is then what they saw, with ``stopped`` when a stop the notebook asked for ended it."""
        from labkit.rank.script import run_script

        def script():
            seed_as_asked(self.seeding, self.rank)
            return run_script(source, path, argv, self.lasting_modules)

        return self._guarded(self._watched(script, watch), timeout_seconds, result_key="value", fresh_process=True)

    def _watched(self, work, watch: dict | None):
        """``work`` as is, or run under a ``LoopWatch`` returning what it saw."""
        if watch is None:
            return work
        from labkit.rank.instruments.loop_watch import LoopWatch, StopRequested

        def watched():
            with LoopWatch(self, stoppable=bool(watch.get("stoppable"))) as loop:
                value = None
                try:
                    value = work()
                except StopRequested:  # asked for by the notebook, and not caught by the loop: a clean end
                    pass
            return {**loop.result(), "value": value}

        return watched

    def _guarded(self, work, timeout_seconds: float, result_key: str, fresh_process: bool = False,
                 stop_before_iteration: bool = False) -> dict:
        """Run user work: the lab's group stands in for the user's init/destroy, exit(0) succeeds; the notebook's
        umask while it runs. ``fresh_process``: the groups the work made go when it ends (a script's).
        ``stop_before_iteration``: a stop the notebook asks for ends it before a DDP forward (``model_steps``)."""
        from labkit.rank.script import ScriptExit, exit_code, lab_process_group

        started = time.perf_counter()
        self.set_collective_timeout(timeout_seconds)
        self.model_steps.begin_work(ControlChannel(self.store, self.rank)
                                    if stop_before_iteration and self.store is not None else None)
        self.displays.begin()
        self.whereabouts.began()
        try:
            with self.user_process.user_umask(), \
                    lab_process_group(self.rank, self.world_size, self.backend, destroy_at_end=fresh_process):
                value = work()
        except SystemExit as exited:  # exit() or sys.exit() in a cell or function
            if exit_code(exited.code):
                return self._failed(ScriptExit(f"exited with code {exit_code(exited.code)}"), started)
            value = None
        except BaseException as error:  # noqa: B036 - KeyboardInterrupt too: reported
            return self._failed(error, started)
        finally:
            self.whereabouts.ended()
            self.displays.end()  # figures drawn and not shown, as after a Jupyter cell
            sys.stdout.flush()
            sys.stderr.flush()
        return {"rank": self.rank, "ok": True, result_key: value, "seconds": time.perf_counter() - started,
                "groups": self.groups.state()}

    def _failed(self, error: BaseException, started: float) -> dict:
        # A late Ctrl-C from the notebook must not cut the clean-up short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.debugging.remember(error)  # %lab debug opens it
        try:
            report = {
                "rank": self.rank,
                "ok": False,
                "seconds": time.perf_counter() - started,
                "error": error_info(error, _own_files()),
            }
            # The groups stay as they are: the notebook reads every rank's report and has the
            # groups released and rebuilt only when a collective was cut (Session.recover).
            report["groups"] = self.groups.state()
            return report
        finally:
            signal.signal(signal.SIGINT, previous)


def _own_files() -> set[str]:
    """The lab's files a traceback of user work passes through above the user's code: left out of reports."""
    from labkit.rank import script

    return {__file__, script.__file__, entry.__file__}
