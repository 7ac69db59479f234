"""A lab's private working directory: made for its owner only, and removed when its owner is gone.

The directory (``labkit-*`` in the temporary folder, mode 0700) holds the
ipyparallel profile, connection files, logs and the control file. ``stop()``
removes it; a lab whose owner was SIGKILLed cannot, so each directory names its
owner (pid and start time) and the next lab to start removes the directories
whose owner no longer runs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import psutil

WORKDIR_PREFIX = "labkit-"
OWNER_FILE = "owner.json"  # which process made a working directory: stale once it is gone


def _process_started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def write_owner(workdir: str) -> None:
    path = os.path.join(workdir, OWNER_FILE)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as handle:
        json.dump({"pid": os.getpid(), "started": _process_started(os.getpid())}, handle)


def owner_only(workdir: str) -> None:
    """Files of the lab readable by its owner only (IPython makes some 0644 inside the 0700 directory)."""
    for folder, _, names in os.walk(workdir):
        os.chmod(folder, 0o700)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o600)


def remove_stale_workdirs(root: str | None = None) -> list[str]:
    """Remove the working directories of labs whose owner died without stopping them (a SIGKILL)."""
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), f"{WORKDIR_PREFIX}*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as handle:
                owner = json.load(handle)
        except (OSError, ValueError):
            continue  # not a lab's, or being made right now
        started = _process_started(owner.get("pid", -1))
        if started is None or (owner.get("started") is not None and abs(started - owner["started"]) > 1):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
