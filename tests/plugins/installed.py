"""Install packages the way a user would, into a temporary folder, and take them away again.

``install_tiny_package`` builds ``tiny_package/`` (a strategy and a model,
declared by entry points only) with pip into a folder of its own: nothing goes
into the lab's environment. ``fake_distribution`` writes just the metadata an
installed package leaves (a ``.dist-info`` folder with ``entry_points.txt``),
for the catalog's unit tests. ``on_path`` makes such a folder importable in this
process and has the catalogs read the installed packages again, before and after.
"""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import shutil
import subprocess
import sys

from labkit.strategies.catalog import refresh_strategies
from labkit.zoo.catalog import refresh_models

TINY_PACKAGE = pathlib.Path(__file__).parent / "tiny_package"


def install_tiny_package(folder: pathlib.Path) -> pathlib.Path:
    """Build and install the tiny package into ``folder / "site"`` (offline, no dependencies); that folder."""
    source, site = folder / "source", folder / "site"
    shutil.copytree(TINY_PACKAGE, source)  # the build writes its egg-info beside the sources: not in the repository
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def fake_distribution(site: pathlib.Path, name: str, entry_points: dict[str, dict[str, str]],
                      modules: dict[str, str] | None = None) -> None:
    """What installing package ``name`` leaves in ``site``: its metadata, entry points and modules."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
        for group, points in entry_points.items()))
    for module, source in (modules or {}).items():
        (site / f"{module}.py").write_text(source)


@contextlib.contextmanager
def on_path(site: pathlib.Path):
    """``site`` importable in this process while the block runs, with the catalogs reading it; then gone."""
    before = set(sys.modules)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    refresh_strategies()
    refresh_models()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for name in set(sys.modules) - before:  # the package's modules, so nothing of it outlives the block
            module = sys.modules[name]
            if str(site) in str(getattr(module, "__file__", "") or ""):
                del sys.modules[name]
        importlib.invalidate_caches()
        refresh_strategies()
        refresh_models()
