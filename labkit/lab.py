"""``Lab``: the plain Python API of labkit. The magics are thin wrappers over it.

    from labkit import Lab
    with Lab(ranks=4) as lab:              # 4 torch.distributed ranks, alive until stop()
        lab.mesh(dp=2, tp=2)               # a named device mesh on every rank
        lab.run(lambda: dist.get_rank())   # -> [0, 1, 2, 3]

A ``Lab`` checks what it is asked and hands the work to its ``Session``, which owns the ranks. Every piece of
work runs under a time limit; when work fails on any rank the session brings stuck ranks back, rebuilds the
process group (and the mesh) on a fresh rendezvous store, and raises one ``RankFailure`` that tells what
happened on which rank. The next call finds a working lab.
"""

from __future__ import annotations

from labkit.cluster.control import check_slowdown
from labkit.cluster.launchers import choose_launcher
from labkit.cluster.placement import RankPlan, plan_ranks
from labkit.runs.push import push_values, run_on
from labkit.runs.status import LabStatus, collect_status
from labkit.runs.launch import launch_training
from labkit.session import Session
from labkit.sites import LabSites, Sites
from labkit.spec.call_arguments import check_seed
from labkit.spec.errors import LabConfigError
from labkit.spec.mesh import MeshError, MeshSpec
from labkit.units import positive_seconds
from labkit.views.metrics import DEFAULT_THRESHOLD
from labkit.wire import entry
from labkit.window import LabWindow

DEFAULT_TIMEOUT = 300.0
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_INTERRUPT_GRACE = 5.0


class Lab(LabSites, LabWindow):
    """A set of live torch.distributed ranks on ipyparallel engines.

    ranks: number of ranks (processes). backend: 'gloo' or 'nccl' (default: nccl when GPUs are visible, one rank
    per GPU, else gloo). timeout: default limit in seconds for each piece of work (a cell, a ``run``).
    start_timeout: limit for the ranks to come up. threads_per_rank: torch threads in each rank (default:
    cores // ranks, at least 1). interrupt_grace: seconds a rank gets to answer an interrupt before it is
    replaced. oversubscribe: start more ranks than the machine's free memory and cores are judged to hold
    (refused otherwise, before anything starts, with the largest count that fits). check_collectives: every
    collective's kind, shapes and dtypes are compared across ranks before it runs, and a mismatch is an error
    naming each rank's call (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; one extra small collective each).

    Past one machine: ``launcher`` is the ipyparallel launcher that starts the engines ('hosted', the lab's own,
    by default; 'mpi', 'ssh', 'slurm', ...), and ``launcher_options`` go to it unchanged (``mpi_args``,
    ``engines``, ...). controller_address: the address of this machine that the ranks reach (default loopback:
    one machine). interface: the network interface gloo/nccl use on every rank (default: the one that reaches
    the controller). ranks_per_host: how many ranks a host may hold (nccl: its GPUs). encrypt: CurveZMQ on every
    ipyparallel connection. Machines join with the command ``join_command()`` prints; behind NAT, over one
    outbound HTTPS line, as sites with ranks of their own: ``join_command(https=True)``, ``site(name)``.
    """

    def __init__(
        self,
        ranks: int = 4,
        backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        threads_per_rank: int | None = None,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
        oversubscribe: bool = False,
        check_collectives: bool = False,
        launcher: str = "hosted",
        controller_address: str | None = None,
        interface: str | None = None,
        ranks_per_host: int | None = None,
        encrypt: bool = False,
        **launcher_options,
    ) -> None:
        # Everything is checked here, before a single process starts.
        chosen = choose_launcher(launcher, **launcher_options)
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            chosen.check_room(ranks)  # ranks of another type are refused below, saying so
        if not isinstance(encrypt, bool):
            raise LabConfigError(f"encrypt is True or False, got {encrypt!r}")
        plan: RankPlan = plan_ranks(ranks, backend=backend, threads_per_rank=threads_per_rank,
                                    oversubscribe=oversubscribe, check_collectives=check_collectives,
                                    controller_address=controller_address, interface=interface,
                                    ranks_per_host=ranks_per_host, on_this_machine=chosen.on_this_machine)
        self.session = Session(
            plan,
            timeout=positive_seconds("timeout", timeout),
            start_timeout=positive_seconds("start_timeout", start_timeout),
            interrupt_grace=positive_seconds("interrupt_grace", interrupt_grace),
            launcher=chosen,
            encrypt=encrypt,
        )
        self._sites: Sites | None = Sites(self.session)  # machines that join over HTTPS (labkit.sites)

    # -- identity -----------------------------------------------------------

    @property
    def plan(self) -> RankPlan:
        return self.session.plan

    @property
    def world_size(self) -> int:
        """Ranks now: those the launcher started and those that joined, less those lost from other machines."""
        return self.session.world_size

    @property
    def launcher(self):
        """The ipyparallel launcher that starts the engines, with its options (a ``LauncherChoice``)."""
        return self.session.launcher

    @property
    def backend(self) -> str:
        return self.session.plan.backend

    @property
    def running(self) -> bool:
        return self.session.running

    @property
    def cluster(self):
        """The processes behind the ranks (pids, engines, logs); None when stopped."""
        return self.session.cluster

    @property
    def generation(self) -> int:
        """How many times the process group was formed since start (it is rebuilt after failures)."""
        return self.session.generation

    @property
    def mesh_spec(self) -> MeshSpec | None:
        return self.session.mesh_spec

    @property
    def started_seconds(self) -> float | None:
        return self.session.started_seconds

    @property
    def timeout(self) -> float:
        """The default limit in seconds for each piece of work (``%lab timeout`` sets it)."""
        return self.session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.session.timeout = positive_seconds("timeout", seconds)

    @property
    def start_timeout(self) -> float:
        return self.session.start_timeout

    @property
    def interrupt_grace(self) -> float:
        return self.session.interrupt_grace

    def __repr__(self) -> str:
        state = f"running, generation {self.generation}" if self.running else "stopped"
        mesh = f", mesh {self.mesh_spec.describe()}" if self.mesh_spec else ""
        return f"<Lab {self.plan.describe()}; {state}{mesh}>"

    # -- start / stop ---------------------------------------------------------

    def start(self) -> "Lab":
        """Start the ranks and form the process group. A running lab is reused."""
        self.session.start()
        return self

    def stop(self) -> None:
        """Stop every process of the lab; nothing is left running. Safe to call twice."""
        self.session.stop()

    def restart(self) -> "Lab":
        """Stop and start again with fresh processes (the mesh spec is kept)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "Lab":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def seed(self, value: int, same: bool = False) -> list[int]:
        """Seed torch, numpy and ``random`` on every rank: ``value + rank``, or ``value`` with ``same``.

        Until then each rank has its own random state, drawn when it started (a replaced
        rank draws afresh), as under torchrun. Returns the seeds."""
        check_seed(value, same, self.world_size)
        return self.session.run(entry.seed, value, same)

    # -- control of running work ----------------------------------------------

    def slow(self, rank: int, seconds: float | None) -> str:
        """Make ``rank`` busy-wait ``seconds`` more each training step (None or 0: back to normal).

        For teaching: a straggler on demand. Takes effect at the rank's next
        step, also during a run; training rows record it, so the dashboard marks it. The delay stays
        below the lab's time limit (``lab.timeout``): a step that long would make every run time out.
        """
        check_slowdown(rank, seconds, self.world_size, self.timeout)  # refused before the ranks are asked
        self.session.require_running()
        return self.session.control.set_slowdown(rank, seconds, self.world_size, self.timeout)

    def link(self, bandwidth=..., latency=...):
        """Put a simulated slow network between the ranks: ``lab.link("100Mbit", "20ms")``; ``lab.link("off")``.

        Every collective of the lab's groups (world group, meshes, training runs) then completes
        later by latency x message rounds + bytes sent / bandwidth (``labkit.spec.link``); the host's
        network is untouched. A part left out adds nothing. Set between runs; replaced ranks and
        restarts keep it. Returns the link in place (a ``LinkSpec``, or None); ``lab.link()`` shows it.
        """
        from labkit.runs.link import set_link

        return set_link(self.session, bandwidth, latency)

    # -- running work ---------------------------------------------------------

    def run(self, fn, *args, ranks=None, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank (or ``ranks``: one, or a list); the results in rank order.

        ``fn`` runs with the rank's namespace as its globals when it was defined in the notebook, so ``rank``,
        ``world_size``, ``mesh``, ``dist`` work in it. ``timeout`` (seconds, default ``lab.timeout``) bounds the
        whole call. ``ranks`` and ``timeout`` are ``run``'s own: ``fn``'s keyword arguments cannot have them."""
        return run_on(self.session, ranks, fn, args, kwargs, timeout)

    def push(self, values: dict | None = None, /, ranks=None, **named) -> None:
        """Put notebook values into every rank's namespace (or ``ranks``'): ``lab.push(helper=helper, np=np)``.

        Notebook functions and classes travel by source, modules by name, the rest pickled; what cannot
        travel is refused before any rank is asked (``labkit.runs.push``). A name ``ranks``: in a dict."""
        push_values(self.session, {**(values or {}), **named}, ranks)

    def run_script(self, path: str, *args, ranks=None, timeout: float | None = None, instruments: bool = False,
                   dashboard: bool = False, background: bool = False):
        """Run a script written for torchrun, unmodified, as ``__main__`` on every rank (or ``ranks``).

        ``args`` become its ``sys.argv[1:]``. Its ``init_process_group`` finds the lab's group,
        ``destroy_process_group()`` leaves it, ``sys.exit(0)`` succeeds (see ``rank.script``). ``instruments``:
        its loop is watched and a ``LoopReport`` returned; ``dashboard`` draws it live; ``background`` returns
        a ``WatchedRun`` at once, whose ``stop()`` ends the loop at a step boundary (see ``runs.script_run``)."""
        from labkit.runs.script_run import run_script

        return run_script(self.session, path, args, ranks, timeout, instruments, dashboard, background)

    def tasks(self, fn, items, timeout: float | None = None, retries: int | None = None, live: bool | None = None,
              sites=None):
        """Run ``fn(item)`` for every item on whichever rank is idle (a work-stealing queue).

        ipyparallel's load-balanced scheduler hands a rank the next task when it is idle, so a
        fast rank does more. A rank lost mid-task is replaced and its task requeued (at most
        ``retries`` times, default the number of ranks): each task completes exactly once.
        ``timeout`` bounds each task. ``sites``: "all" or names of sites whose ranks join the pool
        (a site cut off is left out, its tasks requeued, until its line is back). Returns a
        ``TaskResults`` (values in item order); raises ``TaskFailed`` (with ``.results``) when a
        task raised. See ``labkit.runs.tasks``."""
        from labkit.runs.tasks import run_tasks

        return run_tasks(self.session, fn, items, timeout=timeout, retries=retries, live=live,
                         sites=self.site_sessions(sites))

    def ensemble(self, model: str = "gpt", members: int = 4, steps: int = 30, vary: str = "seed",
                 combine: str = "mean", **settings):
        """Train ``members`` models apart, one per task on the work-stealing queue, and combine them.

        ``vary``: "seed" (own initial weights) or "lr" (learning rates spread around ``lr``);
        ``combine``: "mean" (averaged probabilities) or "vote". Settings: lr, seed, global_batch,
        heldout_batches, optimizer, model_settings, timeout, retries, sites (as ``tasks``: members train on
        their ranks too). Returns an ``EnsembleReport``: each member's held-out score against the ensemble's,
        and their weights. At most 64 members per rank; under vary="lr" at most 16, the largest rate at most 10
        (``labkit.spec.bounds``). See ``labkit.runs.ensemble``."""
        from labkit.runs.ensemble import run_ensemble

        sites = self.site_sessions(settings.pop("sites", None))
        return run_ensemble(self.session, model, members, steps, vary, combine, sites=sites, **settings)

    # -- training ---------------------------------------------------------

    def train(self, strategy: str | None = None, model=None, steps: int | None = None, mesh: dict | None = None,
              data=None, loss=None, resume: bool = False, timeout: float | None = None, dashboard: bool = False,
              background: bool = False, straggler_threshold: float = DEFAULT_THRESHOLD, **settings):
        """Train a model of the zoo, of an installed plugin, or your own, on every rank under ``strategy``.

        strategy: ddp (default), fsdp, tp, pp, diloco, ps, or a composition (fsdp+tp, ddp+pp, pp+tp...). steps: 20.
        model: 'mlp' (default), 'gpt', an installed plugin's model (``model_settings`` resizes it), or your own: a
        class or function of no arguments making an ``nn.Module``, with ``data`` (a map-style ``Dataset``, or
        ``(step, generator) -> batch``) and ``loss`` (``(output, batch) -> scalar``; default cross-entropy); for
        splits: ``fsdp_units``, ``tp_plan``, ``pp_split``; ``attention`` for MFU (docs/own-model.md).
        resume: continue the last run for ``steps`` more steps from the model, optimizer, data position and random
        state the ranks kept (only its length and reporting may change): the same as one run of all the steps.
        mesh: axis sizes for a composition, e.g. ``dict(dp=2, tp=2)`` (default: the lab's mesh when its axes fit,
        else the most even split that fits; it says which). dashboard: throughput, compute/communication, loss and
        stragglers live. background: return a ``TrainingRun`` at once (``wait()``, ``stop()``); else the report.
        straggler_threshold: busy time against the median of like ranks that flags one.
        settings: global_batch, micro_batches, lr, optimizer ('adamw' or 'sgd'), seed, each strategy's own
        (bucket_cap_mb, reshard_after_forward, sequence_parallel, schedule, ...), max_memory (e.g. '64MB' per rank),
        verify (compare with single-process training), log_every, instruments, precision ('fp32' or 'bf16'), tf32,
        peak_tflops, checkpoint_every, checkpoint_dir, auto_heal, on_nonfinite (a NaN or infinite loss: 'stop' the
        run before that step's update, the default; 'skip' that step's update; 'continue' with a warning).
        Everything is checked before any rank works.
        sites ("all" or names): DiLoCo fused across sites, each one replica (inner="ddp" or "fsdp" inside it),
        the outer sync through the hub (wire="bf16" or "fp32", quorum, round_timeout); a ``SitesReport``.
        """
        if settings.get("sites") is not None:  # DiLoCo fused across sites (labkit.sites, runs.site_diloco)
            return self._train_across_sites(dict(strategy=strategy, model=model, steps=steps, data=data, loss=loss,
                                                 dashboard=dashboard, background=background, **settings), timeout)
        run = launch_training(self.session, dict(strategy=strategy, model=model, steps=steps, data=data, loss=loss,
                                                 **settings), mesh,
                              self.session.limit(timeout), dashboard, background, straggler_threshold, resume)
        return run if background else run.wait()

    # -- faults -----------------------------------------------------------

    def kill(self, rank: int) -> str:
        """SIGKILL one rank's process, as a failing machine would (for teaching fault tolerance).

        Allowed while a run trains. The run fails at once (or heals, with ``auto_heal``);
        an idle lab replaces the rank at its next call, or at ``lab.heal()``."""
        return self.session.kill(rank)

    def heal(self):
        """Replace every rank that died or froze, let engines that joined become ranks (a lost rank that
        joined from another machine is dropped), and rebuild the process group; if the last run
        failed after saving checkpoints, go on from the newest one to the step it was to reach.
        Returns that run (in the background, as the failed one was), its report, or None."""
        from labkit.runs.launch import heal_and_go_on

        return heal_and_go_on(self.session)

    # -- checkpoints ------------------------------------------------------

    def model_state(self, timeout: float | None = None) -> dict:
        """The last run's model, whole, as a state dict in the notebook (for ``net.load_state_dict``), gathered
        from however the run split it; every rank takes part."""
        from labkit.runs.checkpoints import model_state

        return model_state(self.session, self.session.limit(timeout))

    def save(self, path: str, timeout: float | None = None) -> str:
        """Save the training state the ranks hold (model, optimizer, step, data position, random
        state) as a checkpoint directory at ``path``: a new path, an empty folder, or a checkpoint
        labkit wrote, which it replaces (anything else is refused, nothing of yours is moved or
        deleted). Atomic: a kill at any instant leaves the old or the new checkpoint whole."""
        from labkit.runs.checkpoints import save

        return save(self.session, path, self.session.limit(timeout))

    def load(self, path: str, mesh: dict | None = None, timeout: float | None = None, **settings):
        """Load a checkpoint (or the newest in a ``checkpoint_dir``) into the ranks, resharded to them.

        ``settings`` may change how it is split (``strategy``, ``mesh``) but not the model. Then
        ``lab.train(steps=N, resume=True)`` continues from its step. Returns the run's config.
        A damaged checkpoint is refused, naming the file, before the ranks drop what they hold."""
        from labkit.runs.checkpoints import load

        return load(self.session, path, self.session.limit(timeout), mesh=mesh, **settings)

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
        self.session.set_mesh(spec)
        return spec

    # -- status and measurements ------------------------------------------

    def status(self, timeout: float = 10.0) -> LabStatus:
        """Every rank: process, liveness, device, process group generation, coordinate."""
        return collect_status(self.session, timeout)

    def bench_collective(self, operation: str = "all_reduce", sizes=None, iterations: int | None = None,
                         warmup: int = 3, timeout: float | None = None):
        """Time one collective over message sizes on every rank, as nccl-tests does.

        Returns a ``CollectiveBench``: the slowest rank's time per size, algorithm
        and bus bandwidth, and the machine's memory-copy bandwidth as the ceiling.
        ``iterations`` (1 to 10,000) and ``warmup`` (0 to 10,000) are checked first; a size above the
        defaults' 16 MiB is checked against the ranks' free memory before any rank allocates it.
        """
        from labkit.runs.bench import run_benchmark

        return run_benchmark(self.session, operation, sizes, iterations, warmup, self.session.limit(timeout))
