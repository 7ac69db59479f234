"""Garbage through every magic: each refused in one line, before any work, with no rank started.

The magics run in IPython's own shell against a ``Lab`` that was never started and
stands on ranks that are not there (``NoRanks``: it knows how many, and any other
use of it is work). A value that reaches work raises ``WorkStarted``: refusing it
must come first. The refusal is a ``UsageError`` or one of the lab's errors that
IPython shows as its one line (``_render_traceback_``), never a raw traceback.
"""

import pytest
from IPython.core.error import UsageError

from labkit import Lab
from tests.conftest import ipython_shell


class WorkStarted(Exception):
    """A magic went past its checks: it asked the ranks for something."""


class NoRanks:
    """Stands where a lab's ranks would be: their number, and nothing else (any other use is work)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __getattr__(self, name: str):
        raise WorkStarted(name)


@pytest.fixture(scope="module")
def shell():
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "labkit")
    yield ip
    ip.run_line_magic("unload_ext", "labkit")


@pytest.fixture()
def magic(shell, monkeypatch, tmp_path):
    """Runs a %lab line (or a %%lab line with a cell) against a 2-rank lab whose ranks are not there."""
    lab = Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=30)
    lab.session.cluster = NoRanks(2)
    magics = shell._labkit_magics
    monkeypatch.setattr(magics, "lab", lab)
    monkeypatch.setattr(Lab, "start", lambda self: (_ for _ in ()).throw(WorkStarted("start")))
    for name, value in dict(fn=abs, items=[1, 2], notalist=3).items():
        monkeypatch.setitem(shell.user_ns, name, value)
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")

    def run(line: str):
        line = line.replace("SCRIPT", str(script))
        if line.startswith("%%"):
            return shell.run_cell_magic("lab", line[2:], "x = 1")
        return shell.run_line_magic("lab", line)

    yield run
    lab.session.cluster = None  # nothing to stop: no rank ever started


def refusal(run, line: str) -> str:
    """The one line a refused ``line`` shows in the notebook."""
    try:
        run(line)
    except UsageError as error:
        return str(error)
    except WorkStarted as work:
        pytest.fail(f"{line!r} was not refused: it went on to work ({work})")
    except Exception as error:  # noqa: BLE001 - what matters is how the notebook shows it
        shown = getattr(error, "_render_traceback_", None)
        assert shown is not None, f"{line!r} raised a raw {type(error).__name__}: {error}"
        lines = shown()
        assert len(lines) == 1, lines
        return lines[0]
    pytest.fail(f"{line!r} was accepted")


GARBAGE = [  # (%lab line, or %%lab line; what its one line says)
    # absurd values of the issue
    ("ensemble --members 100000", "members is a whole number from 1 to 128, got 100000; e.g. members=4 (at most "
                                  "64 per rank: 128 on 2 ranks)"),
    ("ensemble --members 100 --vary lr", "members is a whole number from 1 to 16, got 100; e.g. members=5 with "
                                         "vary='lr'"),
    ("ensemble --members 15 --vary lr --lr 0.1", "the largest of 15 members' learning rates is lr x 128 = 12.8, "
                                                 "above 10: give a smaller lr (at most 0.0781) or fewer members"),
    ("slow 0 1e9s", "the delay is a number of seconds from 0 up to, not including, the lab's time limit (30 s"),
    ("slow 0 30s", "not including, the lab's time limit (30 s"),
    ("bench allreduce --iters -3", "--iters: a repetition count is a whole number from 1 to 10,000, got -3; "
                                   "e.g. --iters 20"),
    ("bench allreduce --iters 0", "from 1 to 10,000, got 0"),
    ("bench allreduce --iters 1000000000000", "from 1 to 10,000, got 1000000000000"),
    ("train --lr 1e308", "lr is a learning rate above 0 and at most 10 (past that training diverges at once), "
                         "got 1e+308; e.g. lr=1e-3"),
    ("train --model-settings dims=abc", "model 'mlp': setting dims is a tuple of whole numbers, got 'abc'; e.g. "
                                        "dims=(128, 512, 512, 512, 128)"),
    ("train --model gpt --model-settings dim=abc", "model 'gpt': setting dim is a whole number, got 'abc'; e.g. "
                                                   "dim=64"),
    # negative, zero, huge, NaN, inf, wrong type, empty, unknown flags: every command
    ("start -1", "ranks must be a whole number >= 0"),
    ("start abc", "N: expected a whole number, got 'abc'"),
    ("start 2 --timeout nan", "--timeout: a time limit must be a positive, finite number of seconds"),
    ("start 2 --threads 0", "threads_per_rank must be a whole number from 1"),
    ("start 2 --bogus", "unknown option --bogus"),
    ("mesh dp=0", "axis dp: size must be a positive integer"),
    ("mesh dp=nan", "cannot read 'dp=nan'"),
    ("train --steps 0", "steps must be a positive integer, got 0"),
    ("train --steps 1000000000000", "steps is a whole number from 1 to 10,000,000"),
    ("train --lr nan", "lr is a learning rate above 0 and at most 10"),
    ("train --lr inf", "lr is a learning rate above 0 and at most 10"),
    ("train --lr -1", "lr is a learning rate above 0 and at most 10"),
    ("train --batch 100000000000", "global_batch is a whole number from 1 to 1,048,576"),
    ("train --micro-batches 100000000", "micro_batches is a whole number from 1 to 1,024"),
    ("train --max-memory abc", "max_memory is written like 64MB"),
    ("train --peak-tflops nan", "peak_tflops is the device's peak in TFLOP/s"),
    ("train --timeout inf", "--timeout: a time limit must be a positive, finite number"),
    ("train --straggler-threshold 0", "straggler_threshold is how many times"),
    ("train --model gpt --model-settings dim=-4", "model 'gpt': setting dim is a size, each at least 1, got -4"),
    ("train --model gpt --model-settings dim=1.5", "setting dim is a whole number, got 1.5"),
    ("train --model-settings =", "--model-settings: write settings as name=value, e.g. dim=128"),
    ("train --bucket-cap-mb inf", "bucket_cap_mb (ddp) is a finite number, got inf"),
    ("train --bucket-cap-mb 1e308", "bucket_cap_mb (ddp) must be below 1e+06"),
    ("train --strategy diloco --outer-lr 1e308", "outer_lr (diloco) must be below 10"),
    ("train --strategy nope", "unknown strategy 'nope'"),
    ("train --bogus", "unknown option --bogus"),
    ("slow 0 -1", "a duration is a finite number of seconds >= 0"),
    ("slow 0 nan", "a duration is a finite number of seconds >= 0"),
    ("slow 99 30ms", "rank must be between 0 and 1, got 99"),
    ("slow abc 30ms", "the rank is a number, got 'abc'"),
    ("link -1Mbit", "a bandwidth must be above zero"),
    ("link nanms", "write the bandwidth with its unit"),
    ("link 100000s", "is too slow for this lab"),
    ("seed -1", "give one seed, a non-negative integer"),
    ("seed 99999999999999999999999999", "a seed is an integer from 0 to 2**63 - 2"),
    ("push", "the following arguments are required: NAME"),
    ("push --ranks 99 fn", "ranks is a rank number or a list of them, each between 0 and 1, got [99]"),
    ("run --ranks -1 SCRIPT", "ranks is a rank number or a list of them, each between 0 and 1, got [-1]"),
    ("run --timeout nan SCRIPT", "%lab run: a time limit must be a positive, finite number"),
    ("run nosuch.py", "cannot run 'nosuch.py': not found"),
    ("bench allreduce --iters nan", "--iters: expected a whole number, got 'nan'"),
    ("bench allreduce --sizes 0", "--sizes: a message size must be at least one byte"),
    ("bench allreduce --sizes 2MB:1KB", "ends below where it starts"),
    ("bench nope", "unknown operation 'nope'"),
    ("checkpoint nope x", "write %lab checkpoint save PATH or %lab checkpoint load PATH"),
    ("kill -1", "say which rank, e.g. %lab kill 1"),
    ("kill 99", "rank must be between 0 and 1, got 99"),
    ("heal x", "%lab heal takes no arguments, got 'x'"),
    ("debug abc", "say which rank, e.g. %lab debug 1"),
    ("debug 99", "each between 0 and 1, got 99"),
    ("tasks fn notalist", "lab.tasks needs a list (or any iterable) of items, got 3"),
    ("tasks fn items --timeout -1", "--timeout: a time limit must be a positive, finite number"),
    ("tasks fn items --timeout nan", "--timeout: a time limit must be a positive, finite number"),
    ("tasks fn items --retries -1", "retries (how often a task may be requeued after its rank is lost) is a whole "
                                    "number from 0 to 1,000, got -1; e.g. retries=2"),
    ("tasks fn items --retries 1000000000", "is a whole number from 0 to 1,000, got 1000000000"),
    ("ensemble --members 0", "members is a positive integer, got 0"),
    ("ensemble --steps 1000000000000", "steps is a whole number from 1 to 10,000,000"),
    ("ensemble --lr 1e308", "lr is a learning rate above 0 and at most 10"),
    ("ensemble --timeout nan", "--timeout: a time limit must be a positive, finite number"),
    ("ensemble --bogus", "unknown option --bogus"),
    ("join-command --https --port 100000", "port is a TCP port number (0-65535"),
    ("join-command --https --ranks 0", "ranks is how many ranks the site runs (1 to 1024)"),
    ("join-command --https --expires nan", "--expires: expected a span of time above zero and at most 7 days"),
    ("join-command --https --expires abc", "--expires: expected a span of time"),
    ("sites x", "%lab sites takes no arguments, got 'x'"),
    ("status x", "%lab status takes no arguments, got 'x'"),
    ("restart now", "%lab restart takes no arguments, got 'now'"),
    ("stop x", "%lab stop takes no arguments, got 'x'"),
    ("who --ranks -1", "each between 0 and 1, got [-1]"),
    ("auto maybe", "write %lab auto (or %lab auto on)"),
    ("timeout abc", "%lab timeout: a time limit is a number of seconds, e.g. 60; got 'abc'"),
    ("timeout 1e308", "%lab timeout: a time limit must be a positive, finite number of seconds, at most 604800"),
    ("timeout 0", "%lab timeout: a time limit must be a positive"),
    ("nosuchcommand", "unknown command 'nosuchcommand'"),
    ("%%--ranks -1", "each between 0 and 1, got [-1]"),
    ("%%--ranks ''", "each between 0 and 1, got []"),
    ("%%--timeout nan", "--timeout: a time limit must be a positive, finite number"),
    ("%%--view nope", "--view: unknown view 'nope'"),
    ("%%--site nowhere", "no site named 'nowhere' is in the lab"),
    ("%%--bogus", "unknown option --bogus"),
]


@pytest.mark.parametrize("line, said", GARBAGE, ids=[line for line, _ in GARBAGE])
def test_garbage_is_refused_in_one_line_before_any_work(magic, line, said):
    assert said in refusal(magic, line)


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "soon"])
def test_a_time_limit_from_python_is_refused_as_the_labs_own_error(timeout):
    # lab.tasks(..., timeout=-1) gave units' plain ValueError and its traceback; every call's limit goes this way
    from labkit.spec.errors import LabConfigError

    lab = Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=30)
    with pytest.raises(LabConfigError, match="timeout"):
        lab.session.limit(timeout)
    with pytest.raises(LabConfigError, match="timeout"):
        lab.tasks(abs, [1, 2], timeout=timeout)
