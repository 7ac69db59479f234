"""Starting a training run: ``lab.train`` and ``lab.heal`` check what was asked and hand over to ``TrainingRun``.

``launch_training`` resolves the settings (with ``resume=True``, the last run's,
with what was given changed), refuses what cannot work before any rank is
asked, enforces the memory budget and starts the run. ``heal_and_go_on``
replaces broken ranks and finishes a run that failed from its newest checkpoint,
watched as it was.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from labkit.runs.budget import enforce_budget
from labkit.runs.healing import TrainingRecord, continuation, has_checkpoint
from labkit.runs.own_model import split_settings
from labkit.runs.own_run_checks import check_run, say_once
from labkit.runs.training_run import TrainingRun
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import BatchSplitError, TrainConfig, resolve, resume_differences, user_settings
from labkit.views.stragglers import check_threshold
from labkit.views.train_report import TrainReport

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session


def _continuation(session: Session, settings: dict, mesh: dict | None) -> tuple[dict, dict | None, TrainingRecord]:
    """Settings and mesh of ``resume=True``: the last run's, with what was given changed; and that run's record."""
    record = session.last_training
    if record is None:
        raise LabConfigError(
            "there is no training run to resume: the lab has not trained since it started, or its ranks formed "
            "a new world since (a rank was replaced, or the lab restarted), or the last run was cut inside an "
            "optimizer step or left the ranks at different steps. Train without resume=True to start afresh."
        )
    before = record.config
    kept = {name: value for name, value in before.as_dict().items() if name in user_settings()}
    given = {name: value for name, value in settings.items() if value is not None}
    if given.get("strategy", before.strategy) == before.strategy:
        kept.update(before.options)  # (another strategy is refused below, saying so)
    mesh = mesh or dict(zip(before.mesh_names, before.mesh_shape))
    return {**kept, **given}, mesh, record


def resolve_run(session: Session, settings: dict, mesh: dict | None, resume: bool = False) -> TrainConfig:
    """The checked ``TrainConfig`` of a run (a continuation of the last one with ``resume``)."""
    record = None
    settings, inspection = split_settings(dict(settings))  # the user's own model packed, before anything else
    if resume:
        settings, mesh, record = _continuation(session, settings, mesh)
    else:  # what was not given takes TrainConfig's and the catalog's defaults
        settings = {name: value for name, value in settings.items() if value is not None}
    try:
        config = resolve(session.world_size, mesh=mesh, lab_mesh=session.mesh_spec, **settings)
    except LabConfigError:
        raise
    except BatchSplitError as error:
        if inspection is not None and inspection.rows is not None:  # the user's function fixes the batch
            raise LabConfigError(f"{error}. Your data function makes each step's batch: make it return "
                                 f"{error.nearest} rows") from None
        raise LabConfigError(str(error)) from None
    except (ValueError, TypeError) as error:
        raise LabConfigError(str(error)) from None
    if record is not None:  # a continuation: it starts where the last run's steps end
        config = replace(config, first_step=record.steps_done)
        differences = resume_differences(record.config, config)
        if differences:
            raise LabConfigError(f"resume continues the last run, so only its length and reporting may change: "
                                 f"{'; '.join(differences)}. Train without resume=True for a new run.")
    if inspection is not None:
        say_once(session.said, [inspection.note, *check_run(inspection, config)])
    return config


def launch_training(session: Session, settings: dict, mesh: dict | None, timeout: float, dashboard: bool,
                    background: bool, straggler_threshold: float, resume: bool = False) -> TrainingRun:
    """``Lab.train``'s work: check everything, enforce the memory budget, start the run."""
    try:
        straggler_threshold = check_threshold(straggler_threshold)
    except ValueError as error:
        raise LabConfigError(str(error)) from None
    config = resolve_run(session, settings, mesh, resume)
    if config.tf32 and session.plan.device_type != "cuda":
        raise LabConfigError("tf32 switches NVIDIA GPUs' matrix units to TensorFloat-32; this lab's ranks run on CPU "
                             "(gloo), where it would change nothing: drop tf32, or start the lab with backend='nccl'")
    session.ready()
    if config.mesh_reason != "given":
        print(f"{config.strategy} without a mesh: using {config.mesh.describe()}, {config.mesh_reason}")
    if config.batch_note and not resume:
        print(f"{config.strategy} on {session.world_size} ranks: {config.batch_note}")
    if config.max_memory is not None and not resume:
        enforce_budget(session, config)
    run = TrainingRun(session, config, timeout, dashboard=dashboard, background=background,
                      straggler_threshold=straggler_threshold)
    session.claim(run)
    try:
        return run.start()
    except BaseException:
        session.release(run)  # a run that never started must not leave the lab busy
        raise


def heal_and_go_on(session: Session) -> TrainingRun | TrainReport | None:
    """``lab.heal()``: replace broken ranks; if the last run failed and saved checkpoints, finish it
    from the newest one, watched as it was. Returns the run (background), its report, or None."""
    session.require_idle()  # a run still going heals itself (auto_heal) or fails first
    note = session.heal()
    interrupted = session.interrupted
    if interrupted is None or not has_checkpoint(interrupted.config):
        if note is None:
            print("labkit: every rank is working, and no failed run with checkpoints is waiting to go on")
        return None
    config = continuation(session, interrupted.config, interrupted.target_step, interrupted.timeout)
    print(f"labkit: going on from the checkpoint at step {config.first_step} to step {interrupted.target_step}",
          flush=True)
    run = TrainingRun(session, config, interrupted.timeout, dashboard=interrupted.dashboard,
                      background=interrupted.background, straggler_threshold=interrupted.straggler_threshold)
    session.claim(run)
    try:
        run.start()
    except BaseException:
        session.release(run)
        raise
    return run if interrupted.background else run.wait()
