"""The torch releases labkit is tested with, and the warning it gives under any other.

labkit reaches into torch.distributed's internals (its registry of process groups,
timeouts, DTensor's caches; every such use is in ``labkit.torch_support.torch_internals``),
and those change between releases without notice. So labkit claims only the
release series its tests run on (``pyproject.toml`` says the same), and says so
once, at ``import labkit``, when the installed torch is another. The check reads
the version file of the installed package, without importing it: the notebook side
never imports torch, and ``import labkit`` stays cheap.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

TESTED_SERIES = ((2, 13),)  # (major, minor) of every torch the test suite runs on
INTERNALS_MODULE = "labkit/torch_support/torch_internals.py"


class TorchVersionWarning(UserWarning):
    """The installed torch is not one labkit is tested with."""


def tested_range_text() -> str:
    return " or ".join(f"{major}.{minor}.x" for major, minor in TESTED_SERIES)


def series_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '2.13.0', '2.11.0+cu130' or '2.14.0a0+git1234'."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def torch_version_problem(version: str | None) -> str | None:
    """None when ``version`` is a tested torch (or unknown: no torch installed here); else what to say."""
    if version is None:
        return None
    if series_of(version) in TESTED_SERIES:
        return None
    return (f"labkit is tested with torch {tested_range_text()}, and this is torch {version}. labkit uses "
            f"torch.distributed internals that change between releases (all in {INTERNALS_MODULE}); "
            f"if the lab misbehaves, install a tested release (pip install 'torch=={TESTED_SERIES[-1][0]}."
            f"{TESTED_SERIES[-1][1]}.*') or check those uses against this one.")


def installed_torch_version() -> str | None:
    """The version of the torch package installed here, without importing it; None if there is none.

    torch's ``version.py`` holds ``__version__ = '2.13.0+cpu'``; reading it costs a millisecond, where
    ``importlib.metadata`` costs tens."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    return None


def warn_if_untested(version: str | None = None, stacklevel: int = 2) -> str | None:
    """Warn (``TorchVersionWarning``) when the installed torch, or ``version``, is not a tested one."""
    problem = torch_version_problem(installed_torch_version() if version is None else version)
    if problem is not None:
        warnings.warn(problem, TorchVersionWarning, stacklevel=stacklevel + 1)
    return problem
