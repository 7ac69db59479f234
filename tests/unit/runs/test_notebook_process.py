"""The notebook's state that travels with user work: which variables, said once, to which ranks (no ranks)."""

import os
import socket
from types import SimpleNamespace

from labkit.runs.notebook_process import NotebookProcess, current_umask


def test_only_the_users_changes_since_the_start_travel_and_are_said_once(monkeypatch, capsys):
    monkeypatch.setenv("KEPT_AS_IT_WAS", "1")
    monkeypatch.setenv("REMOVED_LATER", "1")
    notebook = NotebookProcess()
    assert notebook.state()["environment"] == {} and capsys.readouterr().out == ""
    monkeypatch.setenv("LOSS", "mse")
    monkeypatch.delenv("REMOVED_LATER")
    for lab_own in ("RANK", "MASTER_ADDR", "LOCAL_RANK", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID", "LABKIT_SLOT"):
        monkeypatch.setenv(lab_own, "9")
    assert notebook.state()["environment"] == {"LOSS": "mse", "REMOVED_LATER": None}
    said = capsys.readouterr().out
    assert said == ("labkit: the ranks get the notebook's environment changes since the lab started: "
                    "LOSS set; REMOVED_LATER unset\n")
    monkeypatch.setenv("LOSS", "mae")  # the same names: nothing more to say
    assert notebook.state()["environment"]["LOSS"] == "mae" and capsys.readouterr().out == ""


def test_the_folder_and_umask_go_to_the_ranks_of_this_machine_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    notebook = NotebookProcess()
    state = notebook.state()
    assert state["cwd"] == str(tmp_path) and state["umask"] == current_umask()
    here = SimpleNamespace(host=socket.gethostname(), joined=False)
    assert notebook.state_for(state, here) is state
    for elsewhere in (SimpleNamespace(host="another-machine", joined=False),
                      SimpleNamespace(host=socket.gethostname(), joined=True)):
        assert notebook.state_for(state, elsewhere) == {"environment": state["environment"]}


def test_the_umask_is_read_without_changing_it():
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027
    finally:
        os.umask(before)
