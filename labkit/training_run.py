"""A training run in flight: live metrics, an optional dashboard, a clean stop.

``Lab.train`` makes one. It sends ``train.train`` to every rank and, while the
ranks work, reads the windows of step rows they publish (``ipyparallel``'s
``AsyncResult.data``) into a ``MetricsTable`` that the ``Dashboard`` draws. In
the background (``background=True``) the waiting happens on a thread of its
own: the notebook stays free, the Stop button works, and ``wait()`` hands over
the ``TrainReport``. Stopping never interrupts a collective: it asks the ranks,
through the lab's control file, to finish the step they are in; they agree on
the step to stop after and return what they did. Interrupting the kernel while
a run blocks does the same first, and only then interrupts.
"""

from __future__ import annotations

import threading

from . import rank_runtime
from .dashboard import Dashboard
from .dispatch import RankWork, make_output
from .budget import enforce_budget
from .errors import LabConfigError, LabError, RankFailure, RankInterrupted, RankTimeout
from .metrics import DEFAULT_THRESHOLD, MetricsTable
from .train_config import resolve
from .train_report import TrainReport

STOP_GRACE_SECONDS = 15.0


class TrainingRun:
    def __init__(self, lab, config, timeout: float, dashboard: bool, background: bool,
                 straggler_threshold: float = DEFAULT_THRESHOLD) -> None:
        self.lab = lab
        self.config = config
        self.timeout = timeout
        self.background = background
        mesh = config.mesh
        stage = mesh.names.index("pp") if "pp" in mesh.names else None
        peers = {rank: (mesh.coordinate(rank)[stage] if stage is not None else 0) for rank in range(lab.world_size)}
        self.table = MetricsTable(lab.world_size, config.global_batch, peers, threshold=straggler_threshold)
        self.dashboard = (
            Dashboard(self.table, config.describe(), on_stop=self.stop if background else None,
                      planned_steps=config.steps)
            if dashboard else None
        )
        self.report: TrainReport | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._work: RankWork | None = None

    # -- running ------------------------------------------------------------

    def start(self) -> "TrainingRun":
        from . import train as rank_train

        ranks = list(range(self.lab.world_size))
        self.lab._write_control(stop=False)
        if self.dashboard is not None:
            self.dashboard.show()
        self._work = RankWork(
            self.lab.cluster,
            ranks,
            rank_runtime.call,
            (rank_train.train, (self.config,), {}, None, self.timeout),
            timeout=self.timeout,
            interrupt_grace=self.lab.interrupt_grace,
            # In the background, rank output would land in whatever cell runs then: keep it.
            output=make_output(ranks, live=False if self.background else None, show_values=False,
                               silent=self.background),
            on_tick=self._tick,
            on_interrupt=self._wind_down,
        )
        if self.background:
            threading.Thread(target=self._finish, name="labkit-training-run", daemon=True).start()
        else:
            self._finish()
        return self

    def _tick(self, work: RankWork) -> None:
        for result in work.results.values():
            data = result.data if isinstance(result.data, dict) else {}
            self.table.merge(data.get("labkit_rows"))
        if self.dashboard is not None:
            self.dashboard.update()

    def _wind_down(self) -> float:
        self.stop()
        times = list(self.table.step_times().values())
        return max(STOP_GRACE_SECONDS, 10 * (times[-1] if times else 0.0))

    def _finish(self) -> None:
        work = self._work
        try:
            reports = work.wait()
            self.lab._release(self)  # the ranks are free again: recovery below may use them
            if work.failed:
                recovery = self.lab._recover(work)
                kind = RankInterrupted if work.interrupted else RankTimeout if work.timed_out else RankFailure
                self.error = kind(reports, timed_out=work.timed_out, timeout_seconds=self.timeout,
                                  interrupted=work.interrupted, replaced=tuple(work.replaced), recovery=recovery)
            else:
                results = [reports[rank]["value"] for rank in range(self.lab.world_size)]
                for result in results:
                    self.table.merge_rows(result["rows"])
                self.report = TrainReport(self.config, results)
        except BaseException as error:  # kept for wait(); a background thread has nobody else to tell
            self.error = error
        finally:
            self.lab._write_control(stop=False)
            self.lab._release(self)
            if self.dashboard is not None:
                self.dashboard.finish(self.status())
            self._done.set()

    # -- control --------------------------------------------------------------

    def stop(self) -> None:
        """Ask every rank to stop after the step it is in (they agree on which)."""
        if not self._done.is_set():
            self.lab._write_control(stop=True)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> TrainReport:
        """Block until the run ends; return its report or raise its failure."""
        if not self._done.wait(timeout):
            raise LabError(f"the run is still going after {timeout:g} s; run.stop() ends it at the next step")
        if self.error is not None:
            raise self.error
        return self.report

    def status(self) -> str:
        if not self.done:
            step = self.table.latest_step
            return "starting" if step is None else f"running, step {step + 1} of {self.config.steps}"
        if self.error is not None:
            return f"failed: {str(self.error).splitlines()[0]}"
        report = self.report
        if report.stopped_early:
            return f"stopped after {report.steps_done} of {self.config.steps} steps"
        return f"done: {report.steps_done} steps, loss {report.losses[-1]:.4f}"

    def __repr__(self) -> str:
        return f"<TrainingRun {self.config.describe()}: {self.status()}>"


def launch_training(lab, settings: dict, mesh, timeout: float, dashboard: bool, background: bool,
                    straggler_threshold: float) -> TrainingRun:
    """``Lab.train``'s work: check everything, enforce the memory budget, start the run."""
    try:
        config = resolve(lab.world_size, mesh=mesh, lab_mesh=lab.mesh_spec, **settings)
    except LabConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise LabConfigError(str(error)) from None
    if config.tf32 and lab.plan.device_type != "cuda":
        raise LabConfigError("tf32 switches NVIDIA GPUs' matrix units to TensorFloat-32; this lab's ranks run on CPU "
                             "(gloo), where it would change nothing: drop tf32, or start the lab with backend='nccl'")
    lab._require_idle()
    if config.mesh_reason != "given":
        print(f"{config.strategy} without a mesh: using {config.mesh.describe()}, {config.mesh_reason}")
    if config.max_memory is not None:
        enforce_budget(lab, config)
    run = TrainingRun(lab, config, timeout, dashboard=dashboard, background=background,
                      straggler_threshold=straggler_threshold)
    lab._active_run = run
    return run.start()
