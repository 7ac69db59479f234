"""A Slurm cluster on network-namespace hosts, for the lab's Slurm launcher run for real.

``SlurmHosts(hosts, nodes=(1, 2))`` runs Debian's Slurm on a ``NetnsHosts``: ``slurmctld`` in host 0
(the login node, where the notebook runs), one ``slurmd`` in each of ``nodes`` (the compute nodes,
each with a host name of its own), and one ``munged`` they all authenticate through (the hosts share
this machine's disk, as a real cluster shares its munge key). Everything it writes (``slurm.conf``,
the key, state and spool folders, logs) is in one temporary folder; nothing of the machine's own Slurm
or munge set-up is read or changed. ``environment`` is what the notebook's process needs
(``SLURM_CONF``) for ``sbatch``, ``squeue`` and ``scancel`` to reach this cluster::

    with NetnsHosts(count=3) as hosts, SlurmHosts(hosts, nodes=(1, 2)) as slurm:
        os.environ.update(slurm.environment)
        lab = Lab(ranks=4, launcher="slurm", controller_address=hosts.address(0),
                  options="--ntasks-per-node=2")

``kill_slurmd(i)`` and ``start_slurmd(i)`` take a node's daemon away and back; ``jobs()`` is what
``squeue`` lists; ``node_pids(i)`` what runs on node i besides its ``slurmd``. ``slurm_unavailable()``
says in words why a test must skip, and what to install.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.netns_hosts import NetnsError, NetnsHosts, netns_unavailable
from tests.site_probes import stop, wait_accepting

DAEMONS = {"slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd", "munged": "/usr/sbin/munged"}
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "srun")
START_TIMEOUT = 30.0
# What each node offers Slurm: 4 ranks of one CPU each spread over two nodes by default. Each CPU may be given
# to two jobs at once (OverSubscribe=FORCE:2), so that a replaced rank's job finds room beside the others.
CPUS_PER_NODE = 2
SLURMD_TIMEOUT = 5  # seconds without a node's slurmd before slurmctld marks it down (Slurm's minimum is 1)


def slurm_unavailable() -> str | None:
    """None when a Slurm cluster can run on namespace hosts here; otherwise why not, naming what to install."""
    if os.geteuid() != 0:
        return "Slurm's daemons on namespace hosts need root: run the tests as root"
    for name, path in DAEMONS.items():
        if not os.access(path, os.X_OK):
            package = "munge" if name == "munged" else "slurm-wlm"
            return f"{name} is not installed: apt-get install slurm-wlm munge (it comes with {package})"
    for tool in CLIENTS:
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install slurm-client"
    return netns_unavailable()


class SlurmHosts:
    """slurmctld in host 0, slurmd in each of ``nodes``; see the module docstring. A context manager."""

    def __init__(self, hosts: NetnsHosts, nodes: tuple[int, ...] = (1, 2)):
        self.hosts, self.nodes = hosts, tuple(nodes)
        self.folder: Path | None = None
        self.munged: subprocess.Popen | None = None
        self.controller: subprocess.Popen | None = None
        self.slurmds: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> SlurmHosts:
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="labkit-slurm-"))
            os.chmod(self.folder, 0o700)
            for sub in ("state", "log", *(f"spool-{self.node_name(n)}" for n in self.nodes)):
                (self.folder / sub).mkdir()
            self._start_munge()
            self.config.write_text(self._slurm_conf())
            # Read beside slurm.conf. slurmd loads a cgroup plugin whatever else it is told, and autodetection
            # fails where /sys/fs/cgroup is a tmpfs of v1 hierarchies (a container's); nothing here uses them.
            (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
            self._start_controller()
            for node in self.nodes:
                self.start_slurmd(node)
            self.wait_idle(self.nodes)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def config(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def environment(self) -> dict[str, str]:
        """What a process needs for Slurm's commands to reach this cluster."""
        return {"SLURM_CONF": str(self.config)}

    @staticmethod
    def node_name(host: int) -> str:
        """The host name of host ``host`` ('lab-slurm<host>'): Slurm's node name, and what its jobs see."""
        return f"lab-slurm{host}"

    def _start_munge(self) -> None:
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        # --force: munged checks that its folders are root's and not writable by others; a temporary folder's
        # parent (/tmp) is sticky and world-writable, which it would refuse.
        self.munged = subprocess.Popen(
            ["/usr/sbin/munged", "--foreground", "--force", f"--socket={self.folder / 'munge.socket'}",
             f"--key-file={key}", f"--pid-file={self.folder / 'munged.pid'}",
             f"--log-file={self.folder / 'log' / 'munged.log'}", f"--seed-file={self.folder / 'munge.seed'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(lambda: (self.folder / "munge.socket").exists(), "munged's socket", self.munged,
                   self.folder / "log" / "munged.log")

    def _slurm_conf(self) -> str:
        folder, controller = self.folder, self.hosts.address(0)
        nodes = "\n".join(f"NodeName={self.node_name(n)} NodeAddr={self.hosts.address(n)} CPUs={CPUS_PER_NODE} "
                          "State=UNKNOWN" for n in self.nodes)
        # Processes tracked by process group, no cgroups, no accounting: what a container without systemd
        # can run; everything else is Slurm's default.
        return f"""ClusterName=labkit
SlurmctldHost={self.node_name(0)}({controller})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder / 'munge.socket'}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder / 'state'}
SlurmdSpoolDir={folder / 'spool-%n'}
SlurmctldPidFile={folder / 'slurmctld.pid'}
SlurmdPidFile={folder / 'slurmd-%n.pid'}
SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}
SlurmdLogFile={folder / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT}
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
"""

    def _start_controller(self) -> None:
        log = self.folder / "log" / "slurmctld.out"
        # A host name of its own: slurmctld starts only on the host SlurmctldHost names.
        self.controller = self.hosts.popen(0, ["unshare", "--uts", "sh", "-c",
                                               f"hostname {self.node_name(0)} && exec /usr/sbin/slurmctld -D -i "
                                               f"-f {self.config}"],
                                           stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        self._wait_accepting(0, 6817, self.controller, log)

    def start_slurmd(self, node: int) -> None:
        """Start node ``node``'s slurmd (again), with the node's host name."""
        log = self.folder / "log" / f"slurmd-{node}.out"
        name = self.node_name(node)
        self.slurmds[node] = self.hosts.popen(node, ["unshare", "--uts", "sh", "-c",
                                                     f"hostname {name} && exec /usr/sbin/slurmd -D -N {name} "
                                                     f"-f {self.config}"],
                                              stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                                              stderr=subprocess.STDOUT, env=dict(os.environ, **self.environment))
        self._wait_accepting(node, 6818, self.slurmds[node], log)

    def kill_slurmd(self, node: int) -> None:
        """SIGKILL node ``node``'s slurmd alone: the jobs' steps there (slurmstepd) keep running, as on a real node."""
        server = self.slurmds.pop(node)
        os.kill(server.pid, signal.SIGKILL)  # `sh -c 'exec slurmd'`: the pid is slurmd's
        server.wait(timeout=10)

    def _wait_accepting(self, host: int, port: int, process: subprocess.Popen, log: Path) -> None:
        if not wait_accepting(self.hosts, host, self.hosts.address(host), port, START_TIMEOUT) or \
                process.poll() is not None:
            raise NetnsError(f"Slurm on host {host} is not accepting on port {port} (exit {process.poll()}): "
                             f"{self._tail(log)}")

    def _wait(self, ready, what: str, process: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if process.poll() is not None or time.monotonic() > deadline:
                raise NetnsError(f"{what} did not appear (exit {process.poll()}): {self._tail(log)}")
            time.sleep(0.05)

    @staticmethod
    def _tail(log: Path) -> str:
        try:
            return log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def command(self, argv: list[str], timeout: float = 20.0) -> subprocess.CompletedProcess:
        """One of Slurm's commands run from host 0 (the login node) against this cluster."""
        return subprocess.run(self.hosts.command(0, argv), capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **self.environment))

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it ('idle', 'alloc', 'down*', ...)."""
        listed = self.command(["sinfo", "-N", "-h", "-o", "%N %t"]).stdout.split()
        return dict(zip(listed[::2], listed[1::2]))

    def wait_idle(self, nodes, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``nodes`` have registered and are idle (a node that was down comes back on its own)."""
        names = {self.node_name(n) for n in nodes}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(name, "").startswith(("idle", "mix", "alloc")) for name in names):
                return
            time.sleep(0.2)
        raise NetnsError(f"Slurm's nodes {sorted(names)} did not come up: {self.node_states()}; "
                         f"{self._tail(self.folder / 'log' / 'slurmctld.log')}")

    def jobs(self) -> list[str]:
        """The jobs squeue lists, as 'ID STATE NAME'."""
        return self.command(["squeue", "-h", "-o", "%i %T %j"]).stdout.splitlines()

    def node_pids(self, node: int) -> list[str]:
        """What runs on node ``node`` but its slurmd, as 'PID COMMAND' (an exited zombie is not running)."""
        server = self.slurmds.get(node)
        return self.hosts.running_in(node, besides=[server.pid] if server else [])

    def close(self) -> None:
        """Cancel every job, stop the daemons, remove the folder."""
        if self.controller is not None and self.controller.poll() is None:
            try:
                self.command(["scancel", "--user=root"], timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for server in [*self.slurmds.values(), self.controller, self.munged]:
            if server is not None:
                stop(server, signal.SIGTERM)
        self.slurmds.clear()
        self.controller = self.munged = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
