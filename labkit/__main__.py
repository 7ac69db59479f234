"""Command line: ``python -m labkit tour`` runs the tour headless; ``lab`` opens JupyterLab.

    python -m labkit tour [NOTEBOOK]    execute a notebook, print every cell's text output
    python -m labkit lab [NOTEBOOK]     open JupyterLab (loopback only) on a notebook
    python -m labkit join TOKEN         on another machine: join a lab as its next rank (%lab join-command),
                                        or as a site over one HTTPS line (%lab join-command --https)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TOUR = NOTEBOOKS / "00_tour.ipynb"


def _text_of(output) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("display_data", "execute_result"):
        text = output.get("data", {}).get("text/plain", "")
        return text + ("\n" if text and not text.endswith("\n") else "")
    if kind == "error":
        return "\n".join(output.get("traceback", [])) + "\n"
    return ""


def run_tour(path: Path, cell_timeout: int) -> int:
    """Execute the notebook in a fresh kernel; print each code cell and its output."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=cell_timeout,
        kernel_name="python3",
        allow_errors=True,  # cells that show a failure on purpose carry raises-exception tags
        resources={"metadata": {"path": str(path.parent)}},
    )
    began = time.monotonic()
    try:
        client.execute()
    except CellExecutionError as error:
        print(error, file=sys.stderr)
        return 1
    unexpected = 0
    for number, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code":
            continue
        first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        print(f"\n--- cell {number}: {first}")
        for output in cell.get("outputs", []):
            sys.stdout.write(_text_of(output))
            expected = "raises-exception" in cell.metadata.get("tags", []) or "NBVAL_RAISES_EXCEPTION" in cell.source
            if output.get("output_type") == "error" and not expected:
                unexpected += 1
    print(f"\n{path.name}: ran in {time.monotonic() - began:.1f} s, {unexpected} unexpected error(s)")
    return 1 if unexpected else 0


def open_lab(path: Path) -> int:
    command = [sys.executable, "-m", "jupyter", "lab", str(path), "--ServerApp.ip=127.0.0.1"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    return subprocess.call(command)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tour = commands.add_parser("tour", help="run a notebook headless and print its results")
    tour.add_argument("notebook", nargs="?", type=Path, default=TOUR)
    tour.add_argument("--cell-timeout", type=int, default=600)
    lab = commands.add_parser("lab", help="open JupyterLab on a notebook")
    lab.add_argument("notebook", nargs="?", type=Path, default=TOUR)
    join = commands.add_parser("join", help="start an engine here that joins a lab as its next rank")
    join.add_argument("token", help="the token that %%lab join-command printed")
    join.add_argument("--interface", help="network interface for gloo/nccl here (default: the one that reaches "
                                          "the lab)")
    join.add_argument("--ranks", type=int, help="an HTTPS site: how many ranks to run here (default: one per GPU, "
                                                "else one)")
    join.add_argument("--name", help="an HTTPS site: its name in the lab (default: this machine's host name)")
    join.add_argument("--cafile", help="an HTTPS site whose lab has a certificate of its own: the CA bundle to "
                                       "check it against (default: this machine's trust store)")
    options = parser.parse_args(argv)
    if options.command == "join":
        return _join(parser, options)
    if not options.notebook.exists():
        parser.error(f"no notebook at {options.notebook}")
    if options.command == "tour":
        return run_tour(options.notebook, options.cell_timeout)
    return open_lab(options.notebook)


def _join(parser: argparse.ArgumentParser, options) -> int:
    from labkit.line.token import is_line_token
    from labkit.spec.errors import LabConfigError

    try:
        if is_line_token(options.token):
            from labkit.cluster.site_agent import run_site

            return run_site(options.token, options.ranks, options.name, options.cafile)
        if options.ranks is not None or options.name is not None or options.cafile is not None:
            raise LabConfigError("--ranks, --name and --cafile are for a site that joins over HTTPS; this token "
                                 "joins one engine as the lab's next rank")
        from labkit.cluster.join import run_joined_engine

        return run_joined_engine(options.token, options.interface)
    except LabConfigError as error:
        parser.error(str(error))
    return 2


if __name__ == "__main__":
    sys.exit(main())
