"""``labkit.torchrun``: the comparison launch under real torchrun, and the one failure it repeats."""

import pytest

from labkit import TorchrunFailed, torchrun
from labkit.runs.torchrun import exit_race_only

REPORT = """Traceback (most recent call last):
  File "torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  exitcode  : {other} (pid: 11)  ({other_name})
Root Cause (first observed failure):
[0]:
  exitcode  : -6 (pid: 10)  (SIGABRT)
"""


def report(other=-15, other_name="SIGTERM", worker_said="terminate called without an active exception\n"):
    return worker_said + REPORT.format(other=other, other_name=other_name)


def test_only_the_shutdown_race_is_repeated():
    assert exit_race_only(report())
    # Another abort, a worker's own exit code or a worker's Python error: a real failure.
    assert not exit_race_only(report(worker_said="Fatal Python error: Aborted\n"))
    assert not exit_race_only(report(other=1, other_name="exit 1"))
    assert not exit_race_only("Traceback (most recent call last):\nValueError: bad\n" + report())
    assert not exit_race_only(report(other=-6, other_name="SIGABRT"))  # two aborts, one said why
    assert not exit_race_only("")


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script"):
        torchrun(tmp_path / "missing.py")
    (tmp_path / "ok.py").write_text("print('hi')\n")
    with pytest.raises(ValueError, match="nproc"):
        torchrun(tmp_path / "ok.py", nproc=0)


@pytest.mark.lab
def test_a_failing_script_raises_with_torchrun_s_own_words(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\nraise SystemExit('the script gave up')\n")
    with pytest.raises(TorchrunFailed, match="(?s)torchrun exited with 1.*the script gave up"):
        torchrun(script, nproc=1, timeout=120)
    # One write a line: with PYTHONUNBUFFERED (as in CI) print's pieces are separate writes, which the two
    # workers sharing torchrun's output interleave ("rankrank  01 ...").
    script.write_text("import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} {sys.argv[1:]}\\n\")\n")
    result = torchrun(script, "--flag", "x", nproc=2, timeout=120)
    assert sorted(result.lines("rank")) == ["rank 0 ['--flag', 'x']", "rank 1 ['--flag', 'x']"]
    assert result.retried is None and result.seconds > 0
