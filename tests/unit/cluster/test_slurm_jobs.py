"""The lab's Slurm engine launcher: the batch script it writes, and how it tells a job that no longer runs.

Pure parts, no scheduler: the script is written to a temporary folder, and scontrol's one-line output is
given as text. The launcher run against a real slurmctld and slurmd is tests/lab/test_slurm_launcher.py.
"""

from __future__ import annotations

import shutil

import pytest
from traitlets.config import Config

from labkit.cluster.launchers import choose_launcher
from labkit.cluster.slurm import SlurmEngineSet, describe_job, parse_show_job


def script(tmp_path, **options) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    launcher = SlurmEngineSet(config=Config({"SlurmEngineSet": options}), profile_dir=str(tmp_path), cluster_id="c")
    launcher.write_batch_script(4)
    assert launcher.batch_file.startswith(str(tmp_path))  # the lab's folder, not the current one
    return open(launcher.batch_file).read().splitlines()


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed: choose_launcher refuses "
                    "slurm (tested in test_network); apt-get install slurm-client")
def test_the_slurm_launcher_is_the_labs_own_subclass_with_ipyparallels_options():
    choice = choose_launcher("slurm", options="--gpus-per-node=4", timelimit="01:00:00")
    assert choice.engine_class is SlurmEngineSet and choice.config()["SlurmEngineSet"]["timelimit"] == "01:00:00"


def test_options_reach_sbatch_one_line_each_beside_the_task_count(tmp_path):
    lines = script(tmp_path, options="--ntasks-per-node=2 --gpus-per-node=4 --comment='{x} y'")
    # ipyparallel's own check for a task count reads "--ntasks-per-node" as one: the count must still be there.
    assert "#SBATCH --ntasks=4" in lines
    assert "#SBATCH --ntasks-per-node=2" in lines and "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --comment={x} y" in lines  # braces are the user's, not the template's
    assert lines[0] == "#!/bin/sh" and lines[-1].startswith("srun ")


def test_jobs_are_not_requeued_unless_the_options_say_so(tmp_path):
    assert "#SBATCH --no-requeue" in script(tmp_path / "a")
    lines = script(tmp_path / "b", options="--requeue")
    assert "#SBATCH --requeue" in lines and "#SBATCH --no-requeue" not in lines


def test_a_users_own_batch_template_is_used_as_it_is(tmp_path):
    template = "#!/bin/sh\n#SBATCH --ntasks={n}\nsrun {program_and_args}\n"
    lines = script(tmp_path, batch_template=template, options="--exclusive")
    assert lines[:2] == ["#!/bin/sh", "#SBATCH --ntasks=4"] and not any("exclusive" in line for line in lines)


SHOW = ("JobId=7 JobName=ipengine-x UserId=root(0) JobState={state} Reason={reason} Requeue=0 NodeList={nodes} "
        "Command=./slurm engine.sbatch WorkDir=/w")


@pytest.mark.parametrize(("state", "reason", "failed", "says"), [
    ("CANCELLED", "None", "", "its Slurm job 7 was cancelled (scancel, or an administrator) (CANCELLED)"),
    ("NODE_FAIL", "NodeDown", "n2", "its Slurm job 7 ended because node n2 failed"),
    ("COMPLETING", "NodeDown", "n2", "its Slurm job 7 ended because node n2 failed"),
    ("NODE_FAIL", "NodeDown", "", "its Slurm job 7 ended because a node failed"),
    ("TIMEOUT", "None", "", "its Slurm job 7 reached its time limit (TIMEOUT)"),
    ("PREEMPTED", "None", "", "was preempted"),
    ("BOOT_FAIL", "None", "", "its Slurm job 7 is BOOT_FAIL (BOOT_FAIL)"),
])
def test_a_job_that_no_longer_runs_is_said_in_words(state, reason, failed, says):
    fields = parse_show_job(SHOW.format(state=state, reason=reason, nodes="n[1-2]"))
    assert fields["JobState"] == state and fields["NodeList"] == "n[1-2]" and fields["Command"] == "./slurm"
    assert says in describe_job("7", fields, failed)


def test_a_job_not_yet_submitted_has_no_condition_and_nothing_to_signal_or_stop(tmp_path):
    launcher = SlurmEngineSet(profile_dir=str(tmp_path), work_dir=str(tmp_path), cluster_id="c")
    assert launcher.job_condition() is None and launcher.queue_note() is None
    launcher.signal(9)  # no job: nothing runs, nothing raised


def test_a_refused_submission_says_what_sbatch_said(tmp_path):
    refuse = ["sh", "-c", "echo 'sbatch: error: Batch job submission failed: Invalid account' >&2; exit 1", "sbatch"]
    launcher = SlurmEngineSet(config=Config({"SlurmEngineSet": {"submit_command": refuse}}), profile_dir=str(tmp_path),
                              cluster_id="c")
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): sbatch: error: Batch job submission failed: "
                                           r"Invalid account"):
        launcher.start(2)
    assert launcher.never_runs() is None  # no job was submitted: nothing to ask Slurm


def test_a_job_that_can_never_run_fails_the_start_naming_slurms_reason():
    from types import SimpleNamespace

    from labkit.cluster import health

    never = "Slurm job 3 can never run as asked (PENDING, reason PartitionConfig: ...)"
    sets = {"ranks1": SimpleNamespace(never_runs=lambda: None), "ranks2": SimpleNamespace(never_runs=lambda: never)}
    cluster = SimpleNamespace(cluster=SimpleNamespace(engines=sets), start_timeout=60.0,
                              launcher=SimpleNamespace(name="slurm"), log_path=lambda rank=None: "/nonexistent")
    assert health.never_starting(cluster) == never
    said = health.startup_failure(cluster, 4, {}, never)
    assert said.startswith(f"4 engine(s) cannot start: {never}") and "did not register" not in said
