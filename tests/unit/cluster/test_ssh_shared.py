"""The lab's SSH launcher: one ssh connection per host shared by its engines, and a host asked once (pure: no
ssh is run; the remote shell's answers are played by a subclass). The launcher run against real OpenSSH
servers is tests/lab/test_ssh_launcher.py."""

from __future__ import annotations

from types import SimpleNamespace

from traitlets.config import Config

from labkit.cluster.launchers import choose_launcher
from labkit.cluster.ssh import HostShell, SshEngineSet, shared_connection_args

LINUX = "OS-WIN-CMD=%OS%;OS-WIN-PW=:OS;OS-LINUX=linux-gnu;SHELL=/bin/bash"


class PlayedShell(HostShell):
    """A host shell whose commands are recorded and answered here."""

    def __init__(self, *args, **kwargs):
        self.sent: list[list[str]] = []
        super().__init__(*args, **kwargs)

    def _check_output(self, cmd, **kwargs):
        self.sent.append(list(cmd))
        return LINUX if "echo" in cmd[-1] else ""

    def _runs_successful(self, cmd):
        self.sent.append(list(cmd))
        return True


def test_ssh_shares_one_connection_per_host_unless_the_user_chose_how():
    shared = shared_connection_args("/lab/profile", [])
    assert "ControlMaster=auto" in shared and "ControlPath=/lab/profile/ssh-%C" in shared
    assert any(word.startswith("ControlPersist=") for word in shared)
    assert any(word.startswith("ServerAliveInterval=") for word in shared)  # a cut host ends the shared link
    assert shared_connection_args("/lab/profile", ["-o", "ControlMaster=no"]) == []
    assert shared_connection_args("/lab/profile", ["-o", "controlpath=~/.ssh/cm-%C"]) == []


def test_the_ssh_launcher_is_the_labs_own_and_its_engines_get_the_shared_connection(tmp_path):
    assert choose_launcher("ssh", engines={"node1": 2}).engine_class is SshEngineSet
    engine_set = SshEngineSet(config=Config({"SshEngineSet": {"engines": {"node1": 2}, "ssh_args": ["-i", "key"]}}),
                              profile_dir=str(tmp_path), cluster_id="c")
    assert engine_set.ssh_args[:2] == ["-i", "key"] and f"ControlPath={tmp_path}/ssh-%C" in engine_set.ssh_args
    assert f"ControlPath={tmp_path}/ssh-%C" in engine_set.scp_args


def test_a_host_is_asked_its_shell_and_python_and_makes_a_profile_folder_once():
    shell = PlayedShell(["ssh"], ["node1"], "/opt/py")
    assert shell.get_shell_info() == ("linux-gnu", "/bin/bash")
    assert shell.has_python() and shell.has_python()
    create = ["IPython", "profile", "create", "--profile-dir", "/remote/profile"]
    shell.check_output_python_module(create)
    shell.check_output_python_module(create)
    shell.check_output_python_module([*create[:4], "/remote/other"])  # another folder: made too
    sent = [" ".join(command) for command in shell.sent]
    assert sum("echo" in command for command in sent) == 1
    assert sum("--version" in command for command in sent) == 1
    assert sum("/remote/profile" in command for command in sent) == 1
    assert sum("/remote/other" in command for command in sent) == 1


def test_engines_of_one_host_share_its_shell_and_another_host_has_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr("labkit.cluster.ssh.HostShell", PlayedShell)
    engine_set = SshEngineSet(profile_dir=str(tmp_path), cluster_id="c")

    def engine(location):
        return SimpleNamespace(ssh_cmd=["ssh"], ssh_args=["-i", "key"], location=location, remote_python="/opt/py",
                               log=engine_set.log)

    first, second, other = (engine_set.shell_for(engine(host)) for host in ("node1", "node1", "node2"))
    assert first is second and other is not first
    assert first.args == ["-i", "key", "node1"] and other.args == ["-i", "key", "node2"]
