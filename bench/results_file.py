"""What every benchmark writes beside its numbers: when, on which machine; and the writing itself."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def write_results(path: Path, results: dict) -> None:
    """``results`` as JSON at ``path``, stamped with the time and the machine; say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "machine": {"cores": os.cpu_count(), "python": platform.python_version()}}
    path.write_text(json.dumps({**stamp, **results}, indent=2))
    print(f"\nwrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
