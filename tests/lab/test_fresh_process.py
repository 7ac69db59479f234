"""A script (and a cell) runs as in a fresh torchrun process, on a real 2-rank lab.

Each test is a difference from torchrun found with public programs: the script's
own classes must pickle, its helper modules and random state must not outlive
the run, the groups it made go with it, and its folder, umask and environment
are the notebook's at the time of the call. Where it fits, the same script runs
under a real ``torchrun`` and the two are compared.
"""

import json
import os
import re
from pathlib import Path

import pytest

from labkit import Lab, RankFailure, torchrun

from tests.conftest import ipython_shell, stop_leaving_nothing

pytestmark = pytest.mark.lab

SCRIPT = Path(__file__).parents[1] / "scripts" / "fresh_process.py"
PRESET = "FRESH_PROCESS_PRESET"  # in the notebook's environment when the lab starts


@pytest.fixture(scope="module")
def lab():
    os.environ[PRESET] = "at start"
    running = Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=60, interrupt_grace=3).start()
    try:
        yield running
    finally:
        os.environ.pop(PRESET, None)
        stop_leaving_nothing(running)


def printed(text: str, mode: str) -> dict[int, object]:
    """{rank: value} of the lines ``MODE@RANK {json}`` (labelled ``[rank r]`` in the lab, in any order under
    torchrun)."""
    found = re.findall(rf"^(?:\[rank \d+\] )?{mode}@(\d+) (.*)$", text, re.MULTILINE)
    return {int(rank): json.loads(value) for rank, value in found}


def under_torchrun(*args: str, env: dict | None = None) -> str:
    return torchrun(SCRIPT, *args, nproc=2, env=dict(env or os.environ, GLOO_SOCKET_IFNAME="lo")).stdout


def run(lab, capsys, *args) -> str:
    capsys.readouterr()
    lab.run_script(SCRIPT, *args)
    return capsys.readouterr().out


# -- 2.1 the script is __main__ ------------------------------------------------------------------


def test_classes_the_script_defines_pickle_and_torch_save(lab, capsys, tmp_path):
    main_before = lab.run_cell("import sys\nid(sys.modules['__main__'])")
    said = printed(run(lab, capsys, "pickle", tmp_path), "pickle")
    assert said == {rank: {"loaded": "Net", "module": "__main__", "pickled": True, "forking_pickler": True}
                    for rank in (0, 1)}
    assert lab.run_cell("id(sys.modules['__main__'])") == main_before  # the engine's own __main__ is back


# -- 2.2 helper modules from the script's folder ---------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_helpers_of_the_scripts_folder_do_not_outlive_the_run(lab, capsys, tmp_path):
    main = "import helper\nprint('helper', helper.VALUE)\n"
    first, second = write(tmp_path / "a" / "main.py", main), write(tmp_path / "b" / "main.py", main)
    write(tmp_path / "a" / "helper.py", "VALUE = 'a'\n")
    helper_b = write(tmp_path / "b" / "helper.py", "VALUE = 'b'\n")
    capsys.readouterr()
    lab.run_script(first)
    lab.run_script(second)
    assert re.findall(r"helper (\w+)", capsys.readouterr().out) == ["a", "a", "b", "b"]
    helper_b.write_text("VALUE = 'b, edited'\n")
    lab.run_script(second)
    assert capsys.readouterr().out.count("helper b, edited") == 2
    assert lab.run_cell("import sys\n'helper' in sys.modules") == ["False", "False"]


def test_a_module_a_cell_imported_does_not_shadow_the_scripts_own(lab, capsys, tmp_path):
    write(tmp_path / "cells" / "helper.py", "VALUE = 'the cell'\n")
    write(tmp_path / "script" / "helper.py", "VALUE = 'the script'\n")
    script = write(tmp_path / "script" / "main.py",
                   "import sys\nsys.path.append(sys.argv[1])\nimport helper, extra\nprint('helper', helper.VALUE, extra.VALUE)\n")
    write(tmp_path / "more" / "extra.py", "VALUE = 'extra'\n")
    lab.run_cell(f"import sys\nsys.path.insert(0, {str(tmp_path / 'cells')!r})\nimport helper")
    try:
        capsys.readouterr()
        lab.run_script(script, tmp_path / "more")
        assert capsys.readouterr().out.count("helper the script extra") == 2
        # The cell's module is back, and what the script imported from the folder it added is gone.
        assert lab.run_cell("(helper.VALUE, 'extra' in sys.modules, sys.modules['helper'] is helper)") == \
            ["('the cell', False, True)"] * 2
    finally:
        lab.run_cell(f"sys.path.remove({str(tmp_path / 'cells')!r})\ndel sys.modules['helper'], helper")


# -- 2.3 random state ------------------------------------------------------------------------------


def test_every_run_starts_with_fresh_random_state_unless_seeded(lab, capsys):
    run(lab, capsys, "seed")  # torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    first, second = printed(run(lab, capsys, "draw"), "draw"), printed(run(lab, capsys, "draw"), "draw")
    draws = [*first.values(), *second.values()]
    for position in range(4):
        assert len({draw[position] for draw in draws}) == 4, "each run, each rank: a random state of its own"
    assert all(draw[0] != 0 for draw in draws)
    assert lab.seed(11) == [11, 12]
    run(lab, capsys, "seed")
    seeded = printed(run(lab, capsys, "draw"), "draw")
    assert printed(run(lab, capsys, "draw"), "draw") == seeded  # the seeding asked for is applied again
    assert [seeded[rank][0] for rank in (0, 1)] == [11, 12]


# -- 2.4 and 2.5 working folder and umask ----------------------------------------------------------


def test_cells_and_scripts_run_in_the_notebooks_folder(lab, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert lab.run_cell("import os\nos.getcwd()") == [repr(str(tmp_path))] * 2
    write(tmp_path / "relative.py", "import torch\nrank = torch.distributed.get_rank()\n"
                                    "torch.save(torch.ones(1), f'snapshot-{rank}.pt')\n")
    lab.run_script("relative.py")
    assert sorted(os.listdir(tmp_path)) == ["relative.py", "snapshot-0.pt", "snapshot-1.pt"]
    monkeypatch.chdir(tmp_path.parent)
    assert lab.run(lambda: __import__("os").getcwd()) == [str(tmp_path.parent)] * 2


def rank_umask(pid: int) -> str:
    with open(f"/proc/{pid}/status") as status:
        return next(line.split()[1] for line in status if line.startswith("Umask:"))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_the_users_code_writes_follow_the_notebooks_umask_as_under_torchrun(lab, capsys, tmp_path, umask):
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "lab").mkdir()
    previous = os.umask(umask)
    try:
        # One torchrun launch is enough to show what a fresh process does.
        expected = printed(under_torchrun("write", str(tmp_path / "torchrun")), "write") if umask == 0o022 else None
        said = printed(run(lab, capsys, "write", tmp_path / "lab"), "write")
        cell = lab.run_cell(f"open({str(tmp_path / 'cell')!r} + str(rank), 'w').close()")
    finally:
        os.umask(previous)
    modes = {"file": oct(0o666 & ~umask), "folder": oct(0o777 & ~umask)}
    assert said == {0: modes, 1: modes}
    if expected is not None:
        assert said == expected
    assert cell == [None, None]
    assert oct(os.stat(tmp_path / "cell0").st_mode & 0o777) == modes["file"]
    # The lab's own files stay private: outside the user's code, a rank's umask is the lab's.
    assert {rank_umask(rank.pid) for rank in lab.status().ranks} == {"0077"}


# -- 2.6 groups ------------------------------------------------------------------------------------


def test_groups_a_script_creates_are_destroyed(lab, capsys):
    counts = [printed(run(lab, capsys, "groups"), "groups") for _ in range(3)]
    assert counts[0] == counts[1] == counts[2]
    assert lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == ["2.0", "2.0"]


# -- 2.9 logging ----------------------------------------------------------------------------------

LOGGING_SCRIPT = """import logging, sys
import torch.distributed as dist
dist.init_process_group("gloo")
logging.basicConfig(filename=f"{sys.argv[1]}-{dist.get_rank()}.log", format=sys.argv[2] + " %(message)s",
                    level=logging.INFO)
logging.getLogger("trainer").info("step done")
"""


def test_each_script_starts_with_logging_unconfigured(lab, capsys, tmp_path):
    script = write(tmp_path / "logs.py", LOGGING_SCRIPT)
    lab.run_script(script, tmp_path / "first", "FIRST")
    lab.run_script(script, tmp_path / "second", "SECOND")  # its basicConfig works: its format, its file
    for rank in (0, 1):
        assert (tmp_path / f"first-{rank}.log").read_text() == "FIRST step done\n"  # nothing of the second
        assert (tmp_path / f"second-{rank}.log").read_text() == "SECOND step done\n"
    # The ranks keep no handler of the scripts, and no file of theirs open.
    assert lab.run_cell("import logging, os\n(logging.getLogger().handlers, logging.getLogger('trainer').handlers, "
                        f"[path for path in os.listdir('/proc/self/fd') if {str(tmp_path)!r} in "
                        "os.path.realpath('/proc/self/fd/' + path)])") == ["([], [], [])"] * 2


# -- 2.7 and 2.8 environment -----------------------------------------------------------------------


def test_the_notebooks_environment_changes_reach_the_ranks(lab, capsys, monkeypatch):
    assert printed(run(lab, capsys, "environment"), "environment")[0]["LOSS_KIND"] == "default"
    monkeypatch.setenv("LOSS_KIND", "mse")
    monkeypatch.delenv(PRESET)
    monkeypatch.setenv("RANK", "9")  # the lab's own, per rank: never carried
    capsys.readouterr()
    lab.run_script(SCRIPT, "environment")
    said = capsys.readouterr().out
    assert [value["LOSS_KIND"] for value in printed(said, "environment").values()] == ["mse", "mse"]
    assert [value["variables"]["RANK"] for value in printed(said, "environment").values()] == ["0", "1"]
    carried = [line for line in said.splitlines() if line.startswith("labkit:") and "environment" in line]
    assert len(carried) == 1 and "LOSS_KIND" in carried[0] and PRESET in carried[0], said
    assert not re.search(r"\bRANK\b", carried[0])
    assert "mse" not in carried[0]  # names only: values may be secrets
    assert lab.run_cell(f"import os\n(os.environ.get('LOSS_KIND'), os.environ.get({PRESET!r}))") == \
        ["('mse', None)"] * 2
    assert "LOSS_KIND" not in capsys.readouterr().out  # said once
    monkeypatch.delenv("LOSS_KIND")
    monkeypatch.setenv(PRESET, "at start")
    assert lab.run_cell(f"(os.environ.get('LOSS_KIND'), os.environ.get({PRESET!r}))") == \
        ["(None, 'at start')"] * 2


def test_torchruns_variables_and_argv(lab, capsys, monkeypatch):
    expected = printed(under_torchrun("environment"), "environment")
    monkeypatch.chdir(SCRIPT.parent.parent)
    capsys.readouterr()
    lab.run_script("scripts/fresh_process.py", "environment")
    said = printed(capsys.readouterr().out, "environment")
    for rank in (0, 1):
        theirs, ours = expected[rank]["variables"], said[rank]["variables"]
        assert sorted(name for name, value in ours.items() if value is None) == \
            sorted(name for name, value in theirs.items() if value is None)
        for name in theirs:
            if name not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
                assert ours[name] == theirs[name], name
        assert said[rank]["argv0"] == "scripts/fresh_process.py"  # as typed


# -- 4.5 tracebacks name the notebook's cell -------------------------------------------------------


def test_tracebacks_name_the_notebook_cell_and_the_editors_line(lab):
    shell = ipython_shell()
    shell.run_line_magic("load_ext", "labkit")
    magics = shell.magics_manager.registry["LabMagics"]
    held, magics.lab = magics.lab, lab
    try:
        count = shell.execution_count
        result = shell.run_cell("%%lab\nx = 1\nif rank == 1:\n    raise ValueError('on line 4 of the cell')\n")
        details = result.error_in_exec.details()
    finally:
        magics.lab = held
    assert f'File "<lab cell In[{count}]>", line 4, in <module>' in details
    assert "raise ValueError('on line 4 of the cell')" in details
    with pytest.raises(RankFailure) as caught:
        lab.run_cell("x = 1\nraise ValueError('line 2')")
    assert re.search(r'File "<lab\.run_cell \d+>", line 2, in <module>', caught.value.details())
