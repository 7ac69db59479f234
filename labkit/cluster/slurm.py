"""ipyparallel's Slurm engine launcher, as the lab needs it: options that reach sbatch, a job it can name.

``SlurmEngineSet`` is ipyparallel's ``SlurmEngineSetLauncher`` with these changes, each for something a
user of the lab would otherwise meet:

- its batch script is written beside the lab's own files, not into the notebook's folder;
- its ``options`` ("--ntasks-per-node=2 --gpus-per-node=4") reach ``sbatch``: ipyparallel's default batch
  script has no place for them and drops them silently (a user's own ``batch_template`` is used as it is);
- ``job_condition()`` says, in words, why the set's Slurm job no longer runs (cancelled, its node failed,
  its time limit), asking ``scontrol`` at most every few seconds: a rank whose engine still answers but
  whose job the scheduler ended is named, and replaced, rather than used outside any allocation;
- its jobs are not requeued: the lab replaces a lost rank itself, and a requeued job would start engines no
  one asked for; ``queue_note()`` says why a job still waits, for the lab's "did not register" message, and
  ``never_runs()`` that it never will (``PartitionConfig``, a per-job limit): the start fails at once;
- a failed ``sbatch`` says why (its stderr), and one task of the job can be signalled (``signal_task``: a
  frozen rank is killed on its node, not left there until the job ends);
- ``stop()`` cancels the job and waits (briefly) until ``squeue`` no longer lists it; stopping or signalling
  a job that ended already is not an error printed on the notebook's stderr.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import time

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

# How long a job state read from scontrol is trusted: health checks ask once per rank, and often. A rank
# that is seen lost asks again at once (fresh=True): its job's state changed before the rank was dropped.
STATE_SECONDS = 2.0
# How long stop() waits for the job to leave squeue (Slurm's KillWait, 30 s by default, bounds the
# time a job's processes get between SIGTERM and SIGKILL; engines end at the first).
GONE_SECONDS = 20.0
COMMAND_SECONDS = 10.0
SETTLE_SECONDS = 3.0  # how long a job that is ending (COMPLETING) is watched for how it ended
RUNNING_STATES = ("PENDING", "CONFIGURING", "RUNNING")
# Reasons Slurm gives a pending job that no waiting changes (it asks more than the partition, the QOS or the
# account allows one job, or what no node has): the lab says so at once instead of waiting out start_timeout.
NEVER_REASONS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
                 "InvalidQOS", "QOSMaxCpuPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit",
                 "AssocMaxCpuPerJobLimit", "AssocMaxNodePerJobLimit", "AssocMaxWallDurationPerJobLimit")


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None


def describe_job(job_id: str, fields: dict[str, str], failed_nodes: str = "") -> str:
    """A Slurm job that no longer runs, in words, from ``scontrol show job -o``'s fields (``failed_nodes``: those
    of its nodes Slurm marks down, as the job's own node list shrinks to the nodes still ending it)."""
    state = fields.get("JobState", "?")
    reason = fields.get("Reason", "None")
    failed = f"node {failed_nodes} failed" if failed_nodes else "a node failed"
    said = {"CANCELLED": "was cancelled (scancel, or an administrator)",
            "NODE_FAIL": f"ended because {failed} (its slurmd stopped answering Slurm)",
            "TIMEOUT": "reached its time limit",
            "PREEMPTED": "was preempted by another job",
            "OUT_OF_MEMORY": "ran out of memory",
            "COMPLETED": "ended", "FAILED": "failed", "COMPLETING": "is ending"}.get(state, f"is {state}")
    if reason == "NodeDown" and state in ("COMPLETING", "CANCELLED", "FAILED"):
        said = f"ended because {failed} (its slurmd stopped answering Slurm)"
    detail = "" if reason in ("None", "") else f", reason {reason}"
    return f"its Slurm job {job_id} {said} ({state}{detail})"


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line, as field -> value (values have no spaces but Command's)."""
    fields = {}
    for word in text.split():
        key, _, value = word.partition("=")
        if key and key not in fields:
            fields[key] = value
    return fields


def down_nodes(nodes: str) -> str:
    """Which of ``nodes`` (a Slurm node list, 'lab[1-2]') Slurm marks down or not responding, as 'a, b'."""
    done = _run(["sinfo", "-h", "-N", "-n", nodes, "-o", "%N %t"]) if nodes else None
    if done is None or done.returncode != 0:
        return ""
    pairs = [line.split() for line in done.stdout.splitlines() if len(line.split()) == 2]
    return ", ".join(sorted({name for name, state in pairs if state.startswith(("down", "fail")) or state.endswith("*")}))


class SlurmEngineSet(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher as the lab uses it; see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Beside the lab's own files, not in the notebook's folder (ipyparallel's Cluster gives work_dir='.').
        if self.profile_dir:
            self.batch_file = os.path.join(self.profile_dir, self.batch_file_name)

    _never_read = 0.0
    _condition_read = 0.0
    _condition: str | None = None
    _nodes = ""  # the job's nodes, as scontrol said while it ran

    def _insert_job_array_in_script(self):
        # After ipyparallel's --ntasks line: its test for one reads "--ntasks-per-node" as "--ntasks" too.
        super()._insert_job_array_in_script()
        options = shlex.split(self.options)
        # One #SBATCH line per option, braces doubled: the script is a format string.
        lines = [f"#SBATCH {option}".replace("{", "{{").replace("}", "}}") for option in options]
        if not any("requeue" in option for option in options):
            # The lab replaces a lost rank itself; a job Slurm requeued (after a node failure, by default)
            # would start engines again that nobody asked for.
            lines.append("#SBATCH --no-requeue")
        first, rest = self.batch_template.split("\n", 1)
        self.batch_template = "\n".join([first, *lines, rest])

    def job_condition(self, fresh: bool = False) -> str | None:
        """None while the set's job is pending or running (or cannot be asked); else what ended it."""
        if not self.job_id:
            return None
        now = time.monotonic()
        if not fresh and now - self._condition_read < STATE_SECONDS:
            return self._condition
        fields = self._show()
        self._condition_read = time.monotonic()
        if fields is None:  # Slurm forgot it (MinJobAge) or cannot be asked: nothing to say
            self._condition = None
        else:
            if fields.get("JobState") in RUNNING_STATES:
                self._nodes = fields.get("NodeList", "") or self._nodes
                self._condition = None
            else:
                node_failed = fields.get("JobState") == "NODE_FAIL" or fields.get("Reason") == "NodeDown"
                failed = down_nodes(self._nodes) if node_failed else ""
                self._condition = describe_job(self.job_id, fields, failed)
        return self._condition

    def _fields(self) -> dict[str, str] | None:
        """The job's fields as ``scontrol show job`` gives them; None without a job, or when Slurm cannot say."""
        done = _run(["scontrol", "show", "job", "-o", self.job_id]) if self.job_id else None
        return parse_show_job(done.stdout) if done is not None and done.returncode == 0 else None

    def _show(self) -> dict[str, str] | None:
        """The job's fields; a job still ending for no reason given (cancelled, or its last task ended) is
        asked again for a moment, until Slurm tells how it ended."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            fields = self._fields()
            if fields is None or fields.get("JobState") != "COMPLETING" or fields.get("Reason", "None") != "None" \
                    or time.monotonic() > deadline:
                return fields
            time.sleep(0.2)

    def never_runs(self) -> str | None:
        """Slurm's word that the pending job can never run as asked, or None (asks at most once a second)."""
        now = time.monotonic()
        if not self.job_id or now - self._never_read < 1.0:
            return None
        self._never_read = now
        fields = self._fields() or {}
        reason = fields.get("Reason", "")
        if fields.get("JobState") != "PENDING" or reason not in NEVER_REASONS:
            return None
        return (f"Slurm job {self.job_id} can never run as asked (PENDING, reason {reason}: it asks for more than "
                f"the partition, QOS or account allows one job, or than any node has; scontrol show partition and "
                f"sinfo say what there is)")

    def queue_note(self) -> str | None:
        """What Slurm says of a job still waiting in its queue (no room for it), or None."""
        fields = self._fields() or {}
        if fields.get("JobState") != "PENDING":
            return None
        return (f"Slurm job {self.job_id} is still waiting in the queue (PENDING, reason {fields.get('Reason', '?')}): "
                "the cluster has no room for it now; squeue and sinfo say what holds it")

    def listed(self) -> bool:
        """Whether squeue still lists the job (running, or still ending)."""
        done = _run(["squeue", "-h", "-o", "%i", "-j", self.job_id])
        return done is not None and done.returncode == 0 and self.job_id in done.stdout.split()

    def _run_command(self, command, **kwargs):
        # ipyparallel's leaves the command's stderr on the notebook's and raises only its exit code: sbatch's
        # reason for refusing a job ("Requested node configuration is not available") is what the user needs.
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=COMMAND_SECONDS * 3, **kwargs)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{shlex.join(command)}` did not answer within {COMMAND_SECONDS * 3:g} s: is "
                               "slurmctld reachable from here?") from None
        if done.returncode != 0:
            said = " ".join(done.stderr.split()) or done.stdout.strip() or "nothing"
            raise RuntimeError(f"`{shlex.join(command)}` failed (exit {done.returncode}): {said}")
        return done.stdout

    def signal_task(self, pid: int, node: str, sig: int) -> None:
        """Signal one task of the job, the process ``pid`` on ``node``, with a step beside it (srun --overlap):
        the only way to reach one frozen engine whose controller dropped it, short of cancelling the job."""
        if self.job_id and node:
            _run(["srun", f"--jobid={self.job_id}", "--overlap", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
                  "--quiet", "kill", f"-{int(sig)}", str(pid)])

    def signal(self, sig):
        # A job that ended already has nothing to signal: not an error on the notebook's stderr.
        if self.job_id:
            _run([*self.signal_command, str(sig), self.job_id])

    async def stop(self):
        if not self.job_id:
            return ""
        done = _run([*self.delete_command, self.job_id])
        output = "" if done is None else done.stdout + done.stderr
        self.notify_stop(dict(job_id=self.job_id, output=output))
        deadline = time.monotonic() + GONE_SECONDS
        while self.listed() and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        return output
