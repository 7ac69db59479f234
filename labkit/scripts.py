"""The notebook's side of running a script on the ranks: find it and read it, or say why not.

The source travels to the ranks with the work (``rank_runtime.run_script``),
so what runs is what the notebook read, whatever the ranks' working folder.
"""

from __future__ import annotations

from pathlib import Path

from .errors import LabConfigError


def read_script(path) -> tuple[str, str]:
    """(source, absolute path) of a Python script; LabConfigError if it cannot be run."""
    script = Path(path).expanduser()
    if not script.is_file():
        where = "a folder" if script.is_dir() else "not found"
        raise LabConfigError(f"cannot run {str(path)!r}: {where} (relative to {Path.cwd()}); give the path of a .py file")
    try:
        source = script.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise LabConfigError(f"cannot read {str(path)!r}: {error}") from None
    try:
        compile(source, str(script), "exec")
    except SyntaxError as error:
        raise LabConfigError(f"{path} does not compile, nothing was run: {error.msg} (line {error.lineno})") from None
    return source, str(script.resolve())
