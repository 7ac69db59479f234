"""OpenSSH servers on network-namespace hosts, for the lab's SSH launcher run for real.

``SshHosts(hosts, on=(1, 2))`` starts Debian's ``sshd`` in each of those hosts of a ``NetnsHosts``,
listening on that host's address only, with a host key and a client key pair the test makes and
nothing else accepted (no password, no other key). ``launcher_options({1: 2, 2: 2})`` is what
``Lab(launcher="ssh", ...)`` takes to start two engines on each: ipyparallel's own SSH launcher
options, with the client key, no host-key prompts, this environment's python on the far side, and a
profile folder of each host's own (the hosts share this machine's disk; ipyparallel would otherwise
copy the connection files onto themselves)::

    with NetnsHosts(count=3) as hosts, SshHosts(hosts, on=(1, 2)) as ssh:
        lab = Lab(ranks=4, launcher="ssh", controller_address=hosts.address(0), **ssh.launcher_options({1: 2, 2: 2}))

``remote_pids(i)`` lists what runs in host i besides its sshd (what the lab left there), and
``ssh_unavailable()`` says in words why a test must skip, and what to install.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.netns_hosts import NetnsError, NetnsHosts, netns_unavailable
from tests.site_probes import stop, wait_accepting

SSHD = "/usr/sbin/sshd"
START_TIMEOUT = 15.0


def ssh_unavailable() -> str | None:
    """None when sshd can run on namespace hosts here; otherwise why not, naming what to install."""
    if os.geteuid() != 0:
        return "sshd on namespace hosts needs root: run the tests as root"
    if not os.access(SSHD, os.X_OK):
        return "OpenSSH's server is not installed: apt-get install openssh-server"
    for tool in ("ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install openssh-client"
    return netns_unavailable()


class SshHosts:
    """sshd on hosts ``on`` of ``hosts``; see the module docstring. A context manager."""

    def __init__(self, hosts: NetnsHosts, on: tuple[int, ...] = (1, 2)):
        self.hosts, self.on = hosts, tuple(on)
        self.folder: Path | None = None
        self.servers: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> SshHosts:
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="labkit-ssh-"))
            os.chmod(self.folder, 0o700)
            self._keygen(self.folder / "client")
            (self.folder / "authorized_keys").write_text((self.folder / "client.pub").read_text())
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
            for host in self.on:
                self._start(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _keygen(path: Path) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "labkit test", "-f", str(path)],
                       check=True, capture_output=True, timeout=30)

    def _start(self, host: int) -> None:
        address, name = self.hosts.address(host), f"h{host}"
        self._keygen(self.folder / f"{name}_host_key")
        config = self.folder / f"{name}_sshd_config"
        config.write_text(
            f"ListenAddress {address}\nPort 22\nHostKey {self.folder / f'{name}_host_key'}\n"
            f"PidFile {self.folder / f'{name}_sshd.pid'}\nAuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\nX11Forwarding no\n"
            "AllowTcpForwarding no\nPrintMotd no\nMaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n"
            "Subsystem sftp internal-sftp\n")  # scp speaks SFTP
        log = open(self.folder / f"{name}_sshd.log", "wb")
        # A host name of its own (a UTS namespace), which every session there inherits: the lab tells hosts
        # apart by name, as it would real machines.
        self.servers[host] = self.hosts.popen(host, ["unshare", "--uts", "sh", "-c",
                                                     f"hostname {self.host_name(host)} && exec {SSHD} -D -e -f {config}"],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        if not wait_accepting(self.hosts, host, address, 22, START_TIMEOUT) or self.servers[host].poll() is not None:
            said = (self.folder / f"{name}_sshd.log").read_text(errors="replace")[-2000:]
            raise NetnsError(f"sshd on host {host} is not accepting on {address}:22 "
                             f"(exit {self.servers[host].poll()}): {said}")

    @staticmethod
    def host_name(host: int) -> str:
        """The host name sessions on host ``host`` see: 'lab-ssh<host>'."""
        return f"lab-ssh{host}"

    @property
    def client_options(self) -> list[str]:
        """ssh's and scp's options: the test's key only, no prompt, no known-hosts file touched."""
        return ["-i", str(self.folder / "client"), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=5"]

    def launcher_options(self, engines: dict[int, int]) -> dict:
        """``Lab(launcher="ssh", **options)``'s options for ``engines`` ({host: count})."""
        return dict(
            engines={self.hosts.address(host): {"n": count, "remote_profile_dir": str(self.folder / f"profile-h{host}")}
                     for host, count in engines.items()},
            ssh_args=self.client_options, scp_args=self.client_options, remote_python=sys.executable)

    def run(self, host: int, command: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
        """``command`` run on host ``host`` over ssh from host 0, as the launcher runs its own."""
        return subprocess.run(self.hosts.command(0, ["ssh", *self.client_options, self.hosts.address(host), command]),
                              capture_output=True, text=True, timeout=timeout)

    def remote_pids(self, host: int) -> list[str]:
        """What runs in host ``host`` but its sshd, as 'PID COMMAND' (an exited zombie is not running)."""
        server = self.servers.get(host)
        return self.hosts.running_in(host, besides=[server.pid] if server else [])

    def close(self) -> None:
        """Stop every sshd (its sessions' processes are the test's to check), remove the keys."""
        for server in self.servers.values():
            stop(server, signal.SIGTERM)
        self.servers.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
