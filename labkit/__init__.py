"""labkit: a Jupyter-first lab for distributed training.

``from labkit import Lab`` gives the Python API; ``%load_ext labkit`` gives the
``%lab`` / ``%%lab`` magics, which wrap it. Names are imported on first use, so
``import labkit`` itself stays cheap.
"""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

_EXPORTS = {
    "Lab": "labkit.lab",
    "MeshSpec": "labkit.spec.mesh",
    "MeshError": "labkit.spec.mesh",
    "DeviceError": "labkit.cluster.placement",
    "LabError": "labkit.spec.errors",
    "LabConfigError": "labkit.spec.errors",
    "MemoryBudgetError": "labkit.runs.budget",
    "StartupError": "labkit.spec.errors",
    "RankFailure": "labkit.spec.errors",
    "RankTimeout": "labkit.spec.errors",
    "RankInterrupted": "labkit.spec.errors",
    "LabNotRunning": "labkit.spec.errors",
    "LabBusy": "labkit.spec.errors",
    "NonFiniteLoss": "labkit.views.nonfinite_report",
    "TrainingRun": "labkit.runs.training_run",
    "TrainReport": "labkit.views.train_report",
    "this_rank": "labkit.wire.entry",
    "torchrun": "labkit.runs.torchrun",
    "TaskFailed": "labkit.runs.task_results",
    "SitesReport": "labkit.views.sites_report",
    "SitesRun": "labkit.runs.site_diloco",
    "TorchrunFailed": "labkit.runs.torchrun",
    "StopRequested": "labkit.rank.instruments.loop_watch",
    "log": "labkit.loop_marks",
    "step": "labkit.loop_marks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def load_ipython_extension(shell) -> None:
    """``%load_ext labkit``: register the ``%lab`` magics (the lab itself starts on ``%lab start``)."""
    from labkit.magics import LabMagics

    magics = LabMagics(shell)
    shell.register_magics(magics)
    shell._labkit_magics = magics  # so unload can stop the lab it holds


def unload_ipython_extension(shell) -> None:
    magics = getattr(shell, "_labkit_magics", None)
    if magics is not None:
        magics.close()
        del shell._labkit_magics


# A library logs, the application decides where to: without this, Python's
# last-resort handler would print the cluster's shutdown chatter into notebooks.
logging.getLogger("labkit").addHandler(logging.NullHandler())


def _say_if_torch_is_untested() -> None:
    from labkit.spec.torch_version import warn_if_untested

    warn_if_untested(stacklevel=4)  # points at the user's ``import labkit``


_say_if_torch_is_untested()
