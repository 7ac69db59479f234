"""labkit claims the torch it is tested with, and says so once at import under any other."""

import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from labkit.spec.torch_version import (
    TESTED_SERIES,
    TorchVersionWarning,
    installed_torch_version,
    series_of,
    torch_version_problem,
    warn_if_untested,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version, series", [
    ("2.13.0", (2, 13)), ("2.13.1+cpu", (2, 13)), ("2.11.0+cu130", (2, 11)), ("2.14.0a0+git1a2b", (2, 14)),
    ("10.0", (10, 0)), ("nightly", None),
])
def test_series_of_a_version(version, series):
    assert series_of(version) == series


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.2+cu130"])
def test_a_tested_torch_is_not_mentioned(version):
    assert torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.6.0", "2.14.1", "3.0.0", "nightly"])
def test_another_torch_is_named_with_what_to_do(version):
    problem = torch_version_problem(version)
    assert f"this is torch {version}" in problem and "tested with torch 2.13.x" in problem
    assert "labkit/torch_support/torch_internals.py" in problem and "pip install 'torch==2.13.*'" in problem


def test_no_torch_here_says_nothing():
    assert torch_version_problem(None) is None


def test_the_warning_is_a_torch_version_warning():
    with pytest.warns(TorchVersionWarning, match="this is torch 2.11.0"):
        warn_if_untested("2.11.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_untested("2.13.0") is None


def test_the_installed_torch_is_read_without_importing_it():
    probe = ("import sys; from labkit.spec.torch_version import installed_torch_version as v; "
             "print(v(), 'torch' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    import torch

    assert shown == [torch.__version__, "False"]
    assert installed_torch_version() == torch.__version__


def test_importing_labkit_under_the_tested_torch_warns_nothing():
    done = subprocess.run([sys.executable, "-W", "error", "-c", "import labkit"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pyproject_claims_the_tested_series():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_claim = next(dependency for dependency in dependencies if dependency.startswith("torch"))
    major, minor = TESTED_SERIES[0]
    assert torch_claim.replace(" ", "") == f"torch>={major}.{minor},<{major}.{minor + 1}"
