"""``Lab``: the plain Python API of labkit. The magics are thin wrappers over it.

    from labkit import Lab
    with Lab(ranks=4) as lab:              # 4 torch.distributed ranks, alive until stop()
        lab.mesh(dp=2, tp=2)               # a named device mesh on every rank
        lab.run(lambda: dist.get_rank())   # -> [0, 1, 2, 3]

A ``Lab`` owns one ``RankCluster`` (the processes) and the process group on top
of it. Every piece of work runs under a time limit; when work fails on any rank
the lab brings stuck ranks back, rebuilds the process group (and the mesh) on a
fresh rendezvous store, and raises one ``RankFailure`` that tells what happened
on which rank. The next call finds a working lab.
"""

from __future__ import annotations

import atexit
import time
import weakref

from . import rank_runtime
from .cluster import RankCluster
from .devices import RankPlan, plan_ranks
from .dispatch import RankWork, make_output
from .errors import (
    LabBusy,
    LabConfigError,
    LabError,
    LabNotRunning,
    RankFailure,
    RankInterrupted,
    RankTimeout,
    format_ranks,
)
from .instruments import set_slowdown, write_control
from .mesh import MeshError, MeshSpec
from .scripts import notebook_sources, read_script
from .status import LabStatus, collect_status
from .metrics import DEFAULT_THRESHOLD
from .training_run import launch_training

DEFAULT_TIMEOUT = 300.0
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_INTERRUPT_GRACE = 5.0


def _positive_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _stop_at_exit(lab_ref) -> None:
    lab = lab_ref()
    if lab is not None:
        lab.stop()


class Lab:
    """A set of live torch.distributed ranks on ipyparallel engines.

    ranks: number of ranks (processes). backend: 'gloo' or 'nccl' (default: nccl
    when GPUs are visible, one rank per GPU, else gloo). timeout: default limit
    in seconds for each piece of work (a cell, a ``run``). start_timeout: limit
    for the ranks to come up. threads_per_rank: torch threads in each rank
    (default: cores // ranks, at least 1).
    """

    def __init__(
        self,
        ranks: int = 4,
        backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        threads_per_rank: int | None = None,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        # Everything is checked here, before a single process starts.
        self.plan: RankPlan = plan_ranks(ranks, backend=backend, threads_per_rank=threads_per_rank)
        self.timeout = _positive_seconds("timeout", timeout)
        self.start_timeout = _positive_seconds("start_timeout", start_timeout)
        self.interrupt_grace = _positive_seconds("interrupt_grace", interrupt_grace)
        self.cluster: RankCluster | None = None
        self.generation = 0
        self.mesh_spec: MeshSpec | None = None
        self.started_seconds: float | None = None
        self._atexit = None
        self._active_run = None  # a TrainingRun in flight: the ranks are busy with it
        self._control = {"stop": False, "slow": {}}

    # -- identity -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.plan.ranks

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def running(self) -> bool:
        return self.cluster is not None

    def __repr__(self) -> str:
        state = f"running, generation {self.generation}" if self.running else "stopped"
        mesh = f", mesh {self.mesh_spec.describe()}" if self.mesh_spec else ""
        return f"<Lab {self.plan.describe()}; {state}{mesh}>"

    # -- start / stop ---------------------------------------------------------

    def start(self) -> "Lab":
        """Start the ranks and form the process group. A running lab is reused."""
        if self.running:
            if all(self.cluster.is_alive(rank) for rank in range(self.world_size)):
                return self
            self.stop()
        began = time.monotonic()
        cluster = RankCluster(self.plan, start_timeout=self.start_timeout)
        cluster.start()
        self.cluster = cluster
        self._atexit = lambda ref=weakref.ref(self): _stop_at_exit(ref)
        atexit.register(self._atexit)
        try:
            self._form_group()
            self._check_group()
        except BaseException:
            self.stop()
            raise
        self.started_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every process of the lab; nothing is left running. Safe to call twice."""
        run = self._active_run
        if run is not None and not run.done:
            run.stop()  # let a background run end at a step boundary before the ranks go
            run._done.wait(10)
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.stop()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        self.generation = 0

    def restart(self) -> "Lab":
        """Stop and start again with fresh processes (the mesh spec is kept)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "Lab":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _require_running(self) -> RankCluster:
        if self.cluster is None:
            raise LabNotRunning("the lab is not running: call lab.start() (or %lab start) first")
        return self.cluster

    def _require_idle(self) -> RankCluster:
        cluster = self._require_running()
        if self._active_run is not None and not self._active_run.done:
            raise LabBusy(
                f"a training run is in progress ({self._active_run.status()}): "
                "wait for it (run.wait()) or stop it (run.stop(), or its Stop button) first"
            )
        return cluster

    def _release(self, run) -> None:
        if self._active_run is run:
            self._active_run = None

    def seed(self, value: int, same: bool = False) -> list[int]:
        """Seed torch, numpy and ``random`` on every rank: ``value + rank``, or ``value`` with ``same``.

        Until then each rank has its own random state, drawn when it started (a replaced
        rank draws afresh), as under torchrun. Returns the seeds."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise LabConfigError(f"a seed is an integer from 0 to 2**63 - 1, got {value!r}")
        return self.run(rank_runtime.seed, value, bool(same))

    # -- control of running work ----------------------------------------------

    def _write_control(self, stop: bool | None = None) -> None:
        if stop is not None:
            self._control["stop"] = stop
        if self.cluster is not None and self.cluster.workdir is not None:
            write_control(self.cluster.control_path, self._control)

    def slow(self, rank: int, seconds: float | None) -> str:
        """Make ``rank`` busy-wait ``seconds`` more each training step (None or 0: back to normal).

        For teaching: a straggler on demand. Takes effect at the rank's next
        step, also during a run; training rows record it, so the dashboard marks it.
        """
        self._require_running()
        message = set_slowdown(self._control, rank, seconds, self.world_size)
        self._write_control()
        return message

    # -- process group --------------------------------------------------------

    def _form_group(self) -> None:
        """A fresh rendezvous store on rank 0, every rank joins, the mesh is rebuilt."""
        self.generation += 1
        limit = self.start_timeout
        port = self._call_entry([0], rank_runtime.open_store, (limit,), limit)[0]
        self._call_entry(range(self.world_size), rank_runtime.join_group, (port, self.generation, limit), limit)
        if self.mesh_spec is not None:
            self._build_mesh(self.mesh_spec)

    def _check_group(self) -> None:
        sums = self._call_entry(range(self.world_size), rank_runtime.all_reduce_check, (), self.start_timeout)
        if any(value != self.world_size for value in sums):
            raise LabError(f"the first all-reduce gave {sums}, expected {self.world_size} on every rank")

    def _call_entry(self, ranks, entry, args, timeout):
        """Run a runtime entry point that is not user work, on ``ranks``, within ``timeout``."""
        return self._require_idle().call(ranks, entry, args, timeout)

    def _recover(self, work: RankWork) -> str:
        """After failed work: rebuild the process group so the next call works."""
        cluster = self._require_running()
        dead = [rank for rank in range(self.world_size) if not cluster.is_alive(rank)]
        if dead:
            cluster.replace(dead)
        try:
            self._form_group()
        except LabError:
            # Some rank cannot even rejoin: start it afresh and try once more.
            cluster.replace(range(self.world_size))
            self._form_group()
        replaced = sorted(set(dead) | set(work.replaced))
        note = f"The process group was rebuilt (generation {self.generation})"
        if self.mesh_spec is not None:
            note += f" with mesh {self.mesh_spec.describe()}"
        if replaced:
            note += f"; {format_ranks(replaced)} restarted with empty namespaces"
        return note + "; the lab is ready for the next cell."

    # -- running work ---------------------------------------------------------

    def _targets(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        targets = sorted(set(int(rank) for rank in ranks))
        wrong = [rank for rank in targets if not 0 <= rank < self.world_size]
        if wrong or not targets:
            raise ValueError(f"ranks must be between 0 and {self.world_size - 1}, got {list(ranks)}")
        return targets

    def _limit(self, timeout) -> float:
        return self.timeout if timeout is None else _positive_seconds("timeout", timeout)

    def _execute(self, ranks, entry, args, timeout, live=None, show_values=False) -> dict[int, dict]:
        cluster = self._require_idle()
        limit = self._limit(timeout)
        work = RankWork(cluster, ranks, entry, (*args, limit), timeout=limit, interrupt_grace=self.interrupt_grace,
                        output=make_output(ranks, live=live, show_values=show_values))
        reports = work.wait()
        if not work.failed:
            return reports
        try:
            recovery = self._recover(work)
        except LabError as error:
            recovery = f"The process group could not be rebuilt ({error}); call lab.restart() (or %lab restart)."
        kind = RankInterrupted if work.interrupted else RankTimeout if work.timed_out else RankFailure
        raise kind(reports, timed_out=work.timed_out, timeout_seconds=limit, interrupted=work.interrupted,
                   replaced=tuple(work.replaced), recovery=recovery)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` runs with the rank's namespace as its globals when it was defined
        in the notebook, so ``rank``, ``world_size``, ``mesh``, ``dist`` work in it.
        ``timeout`` (seconds, default ``lab.timeout``) bounds the whole call.
        """
        ranks = self._targets(None)
        reports = self._execute(ranks, rank_runtime.call, (fn, args, kwargs, notebook_sources(fn)), timeout)
        return [reports[rank]["value"] for rank in ranks]

    def run_cell(
        self, code: str, ranks=None, timeout: float | None = None, live: bool | None = None, show_values: bool = False
    ) -> list:
        """Run notebook code on the ranks (all, or ``ranks``); output is labelled by rank.

        Returns the repr of each rank's last expression (None where there is none);
        ``show_values`` also prints them as ``[rank r] Out: ...``, as ``%%lab`` does.
        ``live`` forces (True) or avoids (False) the redrawn notebook display.
        """
        targets = self._targets(ranks)
        reports = self._execute(targets, rank_runtime.run_cell, (code,), timeout, live=live, show_values=show_values)
        return [reports[rank].get("display") for rank in targets]

    def run_script(self, path: str, *args, ranks=None, timeout: float | None = None) -> None:
        """Run a script written for torchrun, unmodified, as ``__main__`` on every rank (or ``ranks``).

        ``args`` become its ``sys.argv[1:]``. Its ``init_process_group`` finds the lab's group,
        ``destroy_process_group()`` leaves it, ``sys.exit(0)`` succeeds (see ``script_runner``).
        """
        source, where = read_script(path)
        self._execute(self._targets(ranks), rank_runtime.run_script, (source, where, [str(a) for a in args]), timeout)

    # -- training ---------------------------------------------------------

    def train(
        self,
        strategy: str = "ddp",
        model: str = "mlp",
        steps: int = 20,
        mesh: dict | None = None,
        timeout: float | None = None,
        dashboard: bool = False,
        background: bool = False,
        straggler_threshold: float = DEFAULT_THRESHOLD,
        **settings,
    ):
        """Train a zoo model on every rank under ``strategy``.

        strategy: ddp, fsdp, tp, pp, or a composition such as fsdp+tp, ddp+pp, pp+tp.
        model: 'mlp' or 'gpt' (``model_settings=dict(dim=128, layers=8)`` resizes it).
        mesh: axis sizes for a composition, e.g. ``dict(dp=2, tp=2)`` (default: the
        lab's mesh when its axes fit, else the most even split that fits; it says which).
        dashboard: draw throughput, compute/communication, collectives, loss and
        stragglers live. background: return a ``TrainingRun`` at once (``run.wait()``
        gives the report; ``run.stop()`` or the Stop button ends it at a step
        boundary); otherwise block and return the ``TrainReport``.
        straggler_threshold: busy time against the median of like ranks that flags one.
        settings: global_batch, micro_batches (accumulation; pipeline microbatches,
        by default one per stage), lr, optimizer ('adamw' or 'sgd'), seed,
        bucket_cap_mb (ddp), reshard_after_forward (fsdp), sequence_parallel (tp),
        schedule ('gpipe' or '1f1b'), max_memory (e.g. '64MB' per rank for
        parameters, gradients and optimizer state), verify (compare with
        single-process training, float32 only), log_every, instruments (False:
        measure nothing), precision ('fp32' or 'bf16'), tf32 (NVIDIA GPUs),
        peak_tflops (one device's peak, for MFU where the lab knows none).
        Everything is checked before any rank does work.
        """
        run = launch_training(self, dict(strategy=strategy, model=model, steps=steps, **settings), mesh,
                              self._limit(timeout), dashboard, background, straggler_threshold)
        return run if background else run.wait()

    # -- mesh -------------------------------------------------------------

    def mesh(self, **axes: int) -> MeshSpec:
        """Build a named device mesh on every rank, e.g. ``lab.mesh(dp=2, tp=2)``.

        The spec is validated before anything runs (positive sizes, one -1 at most,
        product equal to the world size). Returns the spec, which draws itself.
        Without axes, returns the current mesh.
        """
        if not axes:
            if self.mesh_spec is None:
                raise MeshError(f"no mesh yet: give its axes, e.g. lab.mesh(dp={self.world_size})")
            return self.mesh_spec
        spec = MeshSpec.from_axes(axes, self.world_size)
        self._require_running()
        try:
            self._build_mesh(spec)
        except LabError:
            # Leave the lab as it was: a working group with the previous mesh.
            self._form_group()
            raise
        self.mesh_spec = spec
        return spec

    def _build_mesh(self, spec: MeshSpec) -> None:
        ranks = range(self.world_size)
        args = (list(spec.shape), list(spec.names))
        coordinates = self._call_entry(ranks, rank_runtime.build_mesh, args, self.start_timeout)
        for rank, reported in zip(ranks, coordinates):
            if tuple(reported) != spec.coordinate(rank):
                raise LabError(f"rank {rank} reports mesh coordinate {tuple(reported)}, expected {spec.coordinate(rank)}")

    # -- status -----------------------------------------------------------

    def status(self, timeout: float = 10.0) -> LabStatus:
        """Every rank: process, liveness, device, process group generation, coordinate."""
        busy = self._active_run is not None and not self._active_run.done
        return collect_status(self, timeout, training=self._active_run.status() if busy else None)

    # -- collective benchmark ---------------------------------------------

    def bench_collective(self, operation: str = "all_reduce", sizes=None, iterations: int | None = None,
                         warmup: int = 3, timeout: float | None = None):
        """Time one collective over message sizes on every rank, as nccl-tests does.

        Returns a ``CollectiveBench``: the slowest rank's time per size, algorithm
        and bus bandwidth, and the machine's memory-copy bandwidth as the ceiling.
        """
        from .collective_bench import run_benchmark

        return run_benchmark(self, operation, sizes, iterations, warmup, self._limit(timeout))
