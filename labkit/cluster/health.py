"""Why a rank cannot work, told from what this machine can see of it.

A rank of the lab's own launcher is a child of the process host on this
machine: its exit code, a frozen state (SIGSTOP) and its sockets are visible
here. A rank started elsewhere (MPI, SSH, Slurm, a joined machine) is known
only through ipyparallel: the hub drops an engine whose heartbeats stop (it
ended, froze, or its host became unreachable), and the nanny beside it reports
at once when its process ends; a rank in a Slurm job is also told by the job's
state (cancelled, its node failed). All views give the same few words, which the
status table and the failure messages use.
"""

from __future__ import annotations

import time

import psutil

from labkit.cluster.hosted.host_client import HostError
from labkit.spec.errors import StartupError, describe_exit

LOG_TAIL_LINES = 15
DROPPED = ("was dropped by the controller (it stopped answering heartbeats: its process ended or froze, "
           "or its host can no longer be reached)")


def log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            lines = log.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _gone(pid: int) -> bool:
    """Exited, even if its parent has not collected it yet (a zombie)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exit_code(cluster, pid: int, wait: float = 3.0) -> int | None:
    """The code the process host reports for an ended child, waiting a moment for the report
    (on a loaded machine it can take more than a second)."""
    deadline = time.monotonic() + wait
    while cluster.host is not None and pid not in cluster.host.exit_codes and time.monotonic() < deadline:
        time.sleep(0.02)
    return cluster.host.exit_codes.get(pid) if cluster.host is not None else None


def condition(cluster, rank: int) -> str | None:
    """None while ``rank`` can work; else why it cannot."""
    record = cluster.records.get(rank)
    if record is None:
        return "has no process"
    if cluster.launcher.hosted and not record.joined:
        local = _local_condition(cluster, record.pid)
        if local is not None:
            return local
    dropped = cluster.client is not None and record.engine not in cluster.client.ids
    job = _job_condition(cluster, record, fresh=dropped)
    if dropped:
        return DROPPED + (f"; {job}" if job else "")
    # Still answering, but the scheduler ended its job (its node failed, say): not to be used outside an allocation.
    return f"lost its allocation: {job}" if job else None


def _job_condition(cluster, record, fresh: bool) -> str | None:
    """What ended the batch job a rank's engine set is (Slurm's), when it ended; None otherwise. ``fresh``: ask
    the scheduler now, not what it said a moment ago (the rank was just seen lost)."""
    engine_sets = getattr(cluster.cluster, "engines", None) or {}
    ask = getattr(engine_sets.get(record.engine_set), "job_condition", None)
    return ask(fresh=fresh) if ask is not None else None


def _local_condition(cluster, pid: int) -> str | None:
    if cluster.host and pid in cluster.host.exit_codes:
        return f"exited ({describe_exit(cluster.host.exit_codes[pid])})"
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        status = psutil.STATUS_ZOMBIE
    doomed = doomed_by(pid) if status not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else None
    if status == psutil.STATUS_ZOMBIE or doomed == "SIGKILL":
        return f"exited ({describe_exit(exit_code(cluster, pid))})"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) or doomed == "SIGSTOP":
        return "was frozen (stopped by a signal such as SIGSTOP)"
    return None


_PF_EXITING = 0x4  # the kernel's flag of a process on its way out (include/linux/sched.h)
_PENDING = {"SIGKILL": 1 << (9 - 1), "SIGSTOP": 1 << (19 - 1)}


def doomed_by(pid: int) -> str | None:
    """'SIGKILL' when ``pid`` was sent SIGKILL (or is exiting) but has not ended yet, 'SIGSTOP' when it
    was sent SIGSTOP but has not stopped yet; None otherwise.

    A signal is delivered a moment after ``kill()`` returns: a call made right after killing a rank
    would find it still running and send it work it can never do. The kernel shows the pending
    signal (and an exit under way) at once, so such a rank is replaced before the call instead."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        with open(f"/proc/{pid}/stat") as handle:
            flags = int(handle.read().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError, IndexError):
        return None  # gone already (the caller sees that), or no /proc here
    pending = int(fields.get("SigPnd", "0").strip(), 16) | int(fields.get("ShdPnd", "0").strip(), 16)
    if flags & _PF_EXITING or pending & _PENDING["SIGKILL"]:
        return "SIGKILL"
    if pending & _PENDING["SIGSTOP"]:
        return "SIGSTOP"
    return None


def check_capabilities(cluster, seconds: float) -> dict:
    """What the process host's torch can do (its report once torch is imported); refuse nccl without CUDA."""
    try:
        capabilities = cluster.host.capabilities.result(seconds)
    except TimeoutError:
        raise StartupError(f"torch did not finish importing within {cluster.start_timeout:g} s (start_timeout); "
                           f"process host log:\n{log_tail(cluster.log_path())}") from None
    except HostError:
        raise StartupError("the process host could not import torch and ipyparallel; its log says:\n"
                           f"{log_tail(cluster.log_path())}") from None
    if cluster.plan.backend == "nccl" and not (capabilities["cuda_build"] and capabilities["nccl"]):
        raise StartupError(f"nccl was asked for, but this torch ({capabilities['torch']}) has no CUDA/nccl; "
                           "install a CUDA build of torch or use backend='gloo'")
    return capabilities


def infrastructure_problem(cluster) -> str | None:
    """None while the process host and the controller run; else which one went, in words."""
    host = cluster.host
    if host is None or host.process is None or host.process.poll() is not None:
        code = host.process.returncode if host and host.process else None
        return f"the lab's process host exited ({describe_exit(code)}), and every rank with it"
    controller = cluster.cluster.controller if cluster.cluster else None
    if controller is None or controller.pid is None:
        return "the lab's controller is not running"
    pid = controller.pid
    if pid in host.exit_codes or _gone(pid):
        return f"the lab's controller exited ({describe_exit(exit_code(cluster, pid))})"
    return None


def launch_failures(cluster) -> dict[str, int | None]:
    """Engine sets whose launcher reports its process ended while the lab waits for them: set -> exit code."""
    failed = {}
    for name, launcher in (cluster.cluster.engines.items() if cluster.cluster else ()):
        if launcher.state == "after":
            data = launcher.stop_data or {}
            failed[name] = data.get("exit_code")
        elif cluster.launcher.hosted and cluster.host and launcher.pid in cluster.host.exit_codes:
            failed[name] = cluster.host.exit_codes[launcher.pid]
    known = {record.engine_set for record in cluster.records.values()}
    return {name: code for name, code in failed.items() if name not in known}


def _set_name(name: str) -> str:
    """'rank1' (the lab's own launcher, one set per rank) reads 'rank 1'; another launcher's set keeps its name."""
    return f"rank {name[4:]}" if name.startswith("rank") and name[4:].isdigit() else f"engine set {name}"


def _batch_notes(cluster, question: str) -> list[str]:
    """What the engine sets that are batch jobs (Slurm's) answer to ``question`` (a method name), where they do."""
    sets = cluster.cluster.engines.values() if cluster.cluster else ()
    return [said for launcher in sets if (said := getattr(launcher, question, lambda: None)())]


def never_starting(cluster) -> str | None:
    """What a batch system says of an engine set's job that can never run as asked (Slurm's), or None."""
    return next(iter(_batch_notes(cluster, "never_runs")), None)


def startup_failure(cluster, missing: int, dead: dict[str, int | None], never: str | None = None) -> str:
    lines = []
    for name, code in sorted(dead.items()):
        lines.append(f"{_set_name(name)} exited while starting (exit code {code})")
    if never:
        lines.append(f"{missing} engine(s) cannot start: {never}")
    elif missing:
        lines.append(f"{missing} engine(s) did not register within {cluster.start_timeout:g} s (start_timeout) "
                     f"with the {cluster.launcher.name} launcher")
        lines += _batch_notes(cluster, "queue_note")
    for name in sorted(dead)[:2] or ["rank0"]:
        if name.startswith("rank") and name[4:].isdigit():
            tail = log_tail(cluster.log_path(int(name[4:])))
        else:
            tail = log_tail(cluster.log_path(0))  # another launcher writes its set's output there
        if tail:
            lines.append(f"last lines of {_set_name(name)}'s log:\n{tail}")
    lines.append("Nothing was left running. Try again with a longer start_timeout, or fewer ranks.")
    return "\n".join(lines)


def _lab_pids(cluster) -> list[int]:
    pids = [pid for pid in (cluster.host.pid if cluster.host else None,) if pid]
    pids += [record.pid for record in cluster.records.values() if not record.joined]
    if cluster.cluster and cluster.cluster.controller and (cluster.cluster.controller.pid or 0) > 0:
        pids.append(cluster.cluster.controller.pid)
    return pids


def listening_addresses(cluster) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of the lab's processes on this machine."""
    found = []
    for pid in _lab_pids(cluster):
        try:
            family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in family:
            try:
                connections = process.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for connection in connections:
                if connection.status == psutil.CONN_LISTEN:
                    found.append((connection.laddr.ip, connection.laddr.port, process.pid))
    return sorted(set(found))


def process_ids(cluster) -> list[int]:
    """Every process the lab started on this machine (host, controller, engines and their children)."""
    found = set()
    for pid in (cluster.host.pid if cluster.host else None,):
        if not pid:
            continue
        try:
            found.add(pid)
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return sorted(found)
