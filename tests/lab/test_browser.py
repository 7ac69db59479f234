"""The instruments notebook in a real browser: JupyterLab on loopback, headless Chromium.

Playwright drives Debian's Chromium (``executable_path``; no browser download).
The first test opens ``notebooks/05_instruments.ipynb``, runs every cell, checks
that the live dashboard appears and changes while training runs, and saves a
screenshot to ``tests/artifacts/dashboard.png``. The second runs a small notebook
of its own: a foreground dashboard run and a short one under ``--dashboard``;
each must leave one picture (the widget replaced, not followed by a copy), no
progress lines in the cell, and a run whose shown state is its final one. The
third clicks Stop on a foreground dashboard run while its cell blocks: the run
ends early, with its report, and the next cell uses the lab (on a kernel that
jupyter-ui-poll can poll; elsewhere there is no button and it is skipped, saying why).
The fourth runs ``notebooks/15_see_and_debug_every_rank.ipynb``: every rank's plot is drawn
in the page, and the ranks' grid holds a drawn picture for each rank. The last stops a rank at
``breakpoint()`` and types pdb's commands into JupyterLab's own input box.
Without Chromium or Playwright they are skipped with the reason; ``.ci/run``
installs both.
"""

import contextlib
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (apt-get install chromium); .ci/run installs it")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "05_instruments.ipynb", root / "instruments.ipynb")
    # Without its stored outputs: what the page shows is then what this run drew.
    every_rank = json.loads((ROOT / "notebooks" / "15_see_and_debug_every_rank.ipynb").read_text())
    for cell in every_rank["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    (root / "every_rank.ipynb").write_text(json.dumps(every_rank))
    # Every cell rendered: JupyterLab's default windowing hides cells scrolled far out of view
    # (long dashboard outputs), and a hidden cell's output cannot be read or scrolled to.
    settings = root / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port, token = _free_port(), "labkit-browser-test"
    command = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}",
        "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--ServerApp.allow_root=True", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--LabApp.user_settings_dir={root / 'settings'}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
    ]
    log = open(root / "jupyterlab.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"JupyterLab did not start; its log:\n{(root / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    # ``reset``: each page starts with a clean workspace, not with the notebooks an earlier test opened
    # (their cells would be in the page too, hidden in background tabs).
    yield lambda notebook: f"{base}/lab/tree/{notebook}?reset&token={token}", root
    server.terminate()
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


def _run_all_cells(page) -> None:
    """Wait for the kernel, make the notebook the active panel, then Run > Run All Cells.

    On a fresh install JupyterLab takes a while to start the kernel; a command
    chosen before the notebook is active is disabled and does nothing, so the
    click is retried until the first cell shows it has run.
    """
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        page.click(".jp-Notebook .jp-Cell .jp-InputArea-prompt >> nth=0")
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        page.click(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel:text-is('Run All Cells')")
        try:
            page.wait_for_function(
                "() => [...document.querySelectorAll('.jp-InputArea-prompt')].some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))",
                timeout=15_000,
            )
            return
        except Exception:
            page.keyboard.press("Escape")
    raise AssertionError("JupyterLab never started running the notebook")


def _run_to_the_stop(page, failure_picture: str) -> None:
    """Run every cell and wait until the notebook's last cell stopped the lab (a screenshot if it never does)."""
    try:
        _run_all_cells(page)
        page.wait_for_selector("text=lab stopped: no rank, controller or port left", state="attached",
                               timeout=400_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / failure_picture))
        raise


@contextlib.contextmanager
def _notebook_page(url, notebook: str):
    """A headless Chromium page on ``notebook`` in the test's JupyterLab; the browser closes after."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url(notebook))
            yield page
        finally:
            browser.close()


def _dashboard_pictures(page) -> list[str]:
    return page.eval_on_selector_all("img.widget-image", "images => images.map(image => image.src)")


def test_dashboard_renders_and_changes_while_training(jupyterlab):
    url, _ = jupyterlab

    with _notebook_page(url, "instruments.ipynb") as page:
        try:
            _run_all_cells(page)
            # Attached, not visible: JupyterLab may keep cells outside the view unpainted.
            page.wait_for_selector("img.widget-image", state="attached", timeout=180_000)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "failure.png"))
            raise
        page.locator("img.widget-image").first.scroll_into_view_if_needed()
        seen = set()
        deadline = time.monotonic() + 60
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.update(_dashboard_pictures(page))
            time.sleep(0.3)
        assert len(seen) >= 3, "the dashboard picture must change while the run trains"
        page.locator("img.widget-image").first.scroll_into_view_if_needed()
        header = page.locator(".widget-html-content").filter(has_text="under ddp").first.text_content()
        # The run trained: its header counts steps (or says how it ended), never still waits for a first one.
        assert re.search(r": (step \d+|done: \d+ steps)", header or ""), header
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=False)
        # The notebook goes on to the timelines and stops the lab: let it, so no rank is left.
        page.wait_for_selector("text=lab stopped: no rank, controller or port left", state="attached",
                               timeout=300_000)
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
            has_text="Traceback").count() == 0


SHOWN_ONCE_CELLS = [
    "%load_ext labkit\n%lab start 2 --backend gloo --threads 1",
    'report = lab.train("ddp", "mlp", steps=60, log_every=10, dashboard=True)\nprint("foreground done")',
    "run = %lab train --model mlp --steps 5 --dashboard\nrun",
    'run.wait()\nprint("background done")',
    "%lab stop",
]


def _notebook(cells: list[str]) -> dict:
    code = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
            for source in cells]
    return {"cells": code, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                       "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def test_a_dashboard_is_shown_once_without_progress_lines_and_its_run_shows_how_it_ended(jupyterlab):
    url, root = jupyterlab
    (root / "shown_once.ipynb").write_text(json.dumps(_notebook(SHOWN_ONCE_CELLS)))
    with _notebook_page(url, "shown_once.ipynb") as page:
        _run_to_the_stop(page, "shown_once_failure.png")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        foreground, background = cells.nth(1), cells.nth(2)
        foreground.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "dashboard_final.png"), full_page=False)
        for cell in (foreground, background):
            output = cell.locator(".jp-OutputArea")
            # One picture: the live widget was replaced by the final one, not followed by it.
            assert output.locator("img").count() == 1
            assert output.locator("img.widget-image").count() == 0
            assert "[rank 0] step" not in output.inner_text(), "progress lines stay out of the cell"
        assert "foreground done" in foreground.locator(".jp-OutputArea").inner_text()
        shown = background.locator(".jp-OutputArea").inner_text()
        assert "starting" not in shown and "done: 5 steps" in shown, shown
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
            has_text="Traceback").count() == 0


FOREGROUND_STOP_CELLS = [
    "%load_ext labkit\n%lab start 2 --backend gloo --threads 1",
    'report = lab.train("ddp", "mlp", steps=2000, dashboard=True)\n'
    'print(f"stopped early: {report.stopped_early}; steps done: {report.steps_done}")',
    'print("next cell:", lab.train("ddp", "mlp", steps=3).steps_done, "steps")',
    "%lab stop",
]


def test_the_stop_button_stops_a_foreground_dashboard_run(jupyterlab):
    """The cell blocks while the run trains; a click on Stop still ends it at a step boundary."""
    from labkit.runs.training_run import pollable_kernel

    if not pollable_kernel():  # the kernel runs in this interpreter, with the same ipykernel
        pytest.skip("jupyter-ui-poll hands widget messages to a blocked cell on ipykernel 6 only: on this "
                    "ipykernel a foreground run offers no Stop button")

    url, root = jupyterlab
    (root / "foreground_stop.ipynb").write_text(json.dumps(_notebook(FOREGROUND_STOP_CELLS)))
    with _notebook_page(url, "foreground_stop.ipynb") as page:
        training = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
        try:
            _run_all_cells(page)
            # The first steps are on the dashboard: the run is well under way, the cell still blocks.
            training.locator(".widget-html-content").filter(has_text=": step ").first.wait_for(
                state="attached", timeout=180_000)
            stop = training.locator("button:has-text('Stop')")
            stop.wait_for(state="visible", timeout=10_000)
            stop.click()
            page.wait_for_selector("text=lab stopped: no rank, controller or port left", state="attached",
                                   timeout=300_000)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "foreground_stop_failure.png"))
            raise
        said = training.locator(".jp-OutputArea").inner_text()
        assert "stopped early: True" in said, said
        steps_done = int(said.split("steps done: ")[1].split()[0])
        assert 0 < steps_done < 1000, f"the run should stop soon after the click, not at step {steps_done}"
        after = page.locator(".jp-Notebook .jp-CodeCell").nth(2).locator(".jp-OutputArea").inner_text()
        assert "next cell: 3 steps" in after, "the lab is usable in the next cell"
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
            has_text="Traceback").count() == 0


def _drawn_images(locator) -> int:
    """How many <img> under ``locator`` the browser decoded into a picture (not a broken image)."""
    return locator.evaluate_all(
        "outputs => outputs.flatMap(o => [...o.querySelectorAll('img')]).filter(i => i.naturalWidth > 0).length")


def test_every_ranks_plot_is_drawn_in_the_page(jupyterlab):
    url, _ = jupyterlab
    with _notebook_page(url, "every_rank.ipynb") as page:
        _run_to_the_stop(page, "every_rank_failure.png")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        plots = cells.filter(has_text="plt.imshow").locator(".jp-OutputArea")
        plots.first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "every_rank_plots.png"), full_page=False)
        text = plots.first.inner_text()
        assert all(f"[rank {rank}]" in text for rank in range(4)), text
        assert _drawn_images(plots) == 4, "one drawn picture per rank"
        grid = cells.filter(has_text="--view grid").locator(".jp-OutputArea table")
        grid.first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "every_rank_grid.png"), full_page=False)
        assert _drawn_images(grid) == 4 and "rank 3" in grid.first.inner_text()
        said = cells.filter(has_text="lab.debug(2").locator(".jp-OutputArea").inner_text()
        assert "(rank 2 pdb) p 2 - rank" in said and "\n0\n" in said.replace("\r", ""), said


BREAKPOINT_CELLS = [
    "%load_ext labkit\n%lab start 2 --backend gloo --threads 1",
    "%%lab --ranks 1\nsecret = 40 + rank\nbreakpoint()\nprint('after the breakpoint', secret)",
    "%lab stop",
]


def _answer_prompt(page, line: str) -> None:
    """Type ``line`` into the notebook's input box (what input() shows in JupyterLab) and press Enter."""
    box = page.locator(".jp-Stdin-input").last
    box.wait_for(state="visible", timeout=120_000)
    box.fill(line)
    box.press("Enter")


def test_a_breakpoint_on_a_rank_is_served_at_jupyterlabs_own_input_prompt(jupyterlab):
    url, root = jupyterlab
    (root / "breakpoint.ipynb").write_text(json.dumps(_notebook(BREAKPOINT_CELLS)))
    with _notebook_page(url, "breakpoint.ipynb") as page:
        cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
        try:
            _run_all_cells(page)
            _answer_prompt(page, "p secret")
            cell.locator(".jp-OutputArea").filter(has_text="41").first.wait_for(state="attached", timeout=60_000)
            _answer_prompt(page, "c")
            page.wait_for_selector("text=lab stopped: no rank, controller or port left", state="attached",
                                   timeout=120_000)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "breakpoint_failure.png"))
            raise
        said = cell.locator(".jp-OutputArea").inner_text()
        assert "rank 1 stopped at a breakpoint" in said and "[rank 1] after the breakpoint 41" in said, said
