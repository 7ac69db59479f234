"""The notebook's side of sending code to the ranks: scripts to run, and the source of notebook functions.

A script's source travels to the ranks with the work (``wire.entry.run_script``),
so what runs is what the notebook read, whatever the ranks' working folder. A
function defined in a notebook cell has no file the ranks could read its lines
from; its cell's lines travel with it, so a traceback on a rank shows them.
"""

from __future__ import annotations

import linecache
import os
from pathlib import Path

from labkit.spec.errors import LabConfigError


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


def script_argv(path, args) -> list[str]:
    """The script's ``sys.argv``: its path as typed (as a shell passes it on: ``~`` expanded), then ``args``."""
    return [os.path.expanduser(str(path)), *(str(arg) for arg in args)]


def notebook_sources(fn) -> dict[str, list[str]]:
    """{filename: lines} of the notebook cells ``fn`` (and functions it closes over) were defined in."""
    sources, seen, pending = {}, set(), [fn]
    while pending:
        item = pending.pop()
        code = getattr(item, "__code__", None)
        if code is None or id(item) in seen:
            continue
        seen.add(id(item))
        filename = code.co_filename
        if filename not in sources and not os.path.exists(filename):
            lines = linecache.getlines(filename)
            if lines:
                sources[filename] = lines
        pending.extend(cell.cell_contents for cell in (getattr(item, "__closure__", None) or ())
                       if callable(getattr(cell, "cell_contents", None)))
    return sources
