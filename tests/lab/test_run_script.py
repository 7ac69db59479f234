"""Scripts written for torchrun run unmodified in the lab, with the same results (4 real ranks).

Each script in ``tests/scripts`` (and the workshop's DDP trainer) is in the style of a public example (a DDP
trainer with argparse and a Trainer class, tensor parallelism with
``parallelize_module``, FSDP2's ``fully_shard``, a GPipe pipeline): its own
``init_process_group``, torchrun's variables, ``destroy_process_group`` at the
end. Each runs under ``torchrun --standalone`` and under ``lab.run_script``;
the printed results must be equal to the last bit.
"""

import os
import re
from pathlib import Path

import pytest

from labkit import LabConfigError, RankFailure, torchrun

from tests.conftest import ipython_shell

pytestmark = pytest.mark.lab

SCRIPTS = Path(__file__).parents[1] / "scripts"
WORKSHOP_SCRIPTS = Path(__file__).parents[2] / "notebooks" / "scripts"  # the DDP trainer, shared with notebook 06
RESULT = re.compile(r"^(?:\[rank \d+\] )?((?:world 4|tp|fsdp|pipeline) loss \S+ checksum \S+)$", re.MULTILINE)


def under_torchrun(script: Path, *args: str) -> str:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    return RESULT.findall(torchrun(script, *args, nproc=4, env=env).stdout)


@pytest.mark.parametrize("script, args", [
    (WORKSHOP_SCRIPTS / "ddp_trainer.py", ("--epochs", "3")),
    (SCRIPTS / "tp_example.py", ()),
    (SCRIPTS / "fsdp2_example.py", ()),
    (SCRIPTS / "pipeline_example.py", ()),
], ids=["ddp_trainer", "tp_example", "fsdp2_example", "pipeline_example"])
def test_the_same_script_gives_the_same_result_as_under_torchrun(lab, capsys, script, args):
    expected = under_torchrun(script, *args)
    assert len(expected) == 1, expected
    capsys.readouterr()
    lab.run_script(script, *args)
    said = capsys.readouterr().out
    assert RESULT.findall(said) == expected  # bitwise: the same digits
    assert "init_process_group: the lab's process group is already in place" in said
    assert "destroy_process_group(): the lab keeps its process group" in said
    # The lab's group survived the script's destroy_process_group().
    assert lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == ["4.0"] * 4


def test_exits_argv_and_the_scripts_folder(lab, capsys):
    lab.run_script(SCRIPTS / "exits.py", "exit")
    said = capsys.readouterr().out
    assert said.count("name __main__ argv ['exit'] helper 42") == 4
    assert "must not run" not in said and "end of script" not in said
    lab.run_script(SCRIPTS / "exits.py", "zero")
    lab.run_script(SCRIPTS / "exits.py", "ok")
    assert capsys.readouterr().out.count("end of script") == 4
    with pytest.raises(RankFailure) as caught:
        lab.run_script(SCRIPTS / "exits.py", "code")
    assert str(caught.value).startswith("rank 1 raised ScriptExit: the script exited with code 3")
    with pytest.raises(RankFailure) as caught:
        lab.run_script(SCRIPTS / "exits.py", "raise")
    assert "raise ValueError(\"a mistake in the script\")" in caught.value.details()  # the script's own line


def test_an_incompatible_init_is_refused_with_the_reason(lab):
    with pytest.raises(RankFailure) as caught:
        lab.run_script(SCRIPTS / "exits.py", "nccl")
    assert "this lab's ranks run gloo; start the lab with backend='nccl'" in str(caught.value)


def test_what_cannot_run_is_refused_before_anything_runs(lab, tmp_path):
    with pytest.raises(LabConfigError, match="not found"):
        lab.run_script(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n    pass\n")
    with pytest.raises(LabConfigError, match="does not compile, nothing was run"):
        lab.run_script(broken)


def test_run_magic(capsys):
    shell = ipython_shell()
    shell.run_line_magic("load_ext", "labkit")
    try:
        shell.run_line_magic("lab", "start 2 --backend gloo --threads 1")
        shell.run_line_magic("lab", f"run --ranks 0 --timeout 60 {SCRIPTS / 'exits.py'} ok --flag")
        said = capsys.readouterr().out
        assert "argv ['ok', '--flag']" in said and said.count("end of script") == 1
        from IPython.core.error import UsageError

        with pytest.raises(UsageError, match="give the script"):
            shell.run_line_magic("lab", "run --ranks 0")
    finally:
        shell.run_line_magic("lab", "stop")
        shell.run_line_magic("unload_ext", "labkit")
