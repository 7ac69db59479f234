"""``RankWork``'s escalation against a fake cluster: answer, SIGINT, replace, died. No processes.

Each fake rank is scripted: when it answers on its own, how long after a SIGINT
it answers (or never), and when its process dies. The settle time past the
limit is shortened (its formula is checked on its own) so the file runs in
about a second.
"""

import signal
import time

import pytest

from labkit.spec.errors import describe_exit
from labkit.runs import dispatch
from labkit.runs.dispatch import RankWork, make_output

TIMEOUT = 0.2
GRACE = 0.2
SETTLE = 0.05


def entry(*args):  # what the work applies on each rank; never called here
    raise AssertionError("the fake cluster does not run entry points")


def ok(rank, **extra):
    return {"rank": rank, "ok": True, **extra}


class FakeResult:
    """An ipyparallel AsyncResult whose answer lands at a scripted moment."""

    def __init__(self, rank, value, answer_after=None, on_sigint=None, stdout="", stderr=""):
        self.rank = rank
        self.value = value  # a report dict, or an exception that get() raises
        self.answer_after = answer_after  # seconds after submission; None: not on its own
        self.on_sigint = on_sigint  # seconds from SIGINT to answering; None: ignores it
        self.submitted = None
        self.ready_at = None
        self.stdout, self.stderr = stdout, stderr
        self.data = {}
        self.output_waits = []
        self.gets = 0

    def submit(self):
        self.submitted = time.monotonic()
        if self.answer_after is not None:
            self.ready_at = self.submitted + self.answer_after

    def interrupt(self):
        if self.on_sigint is not None and (self.ready_at is None or not self.ready()):
            self.ready_at = time.monotonic() + self.on_sigint

    def ready(self):
        return self.ready_at is not None and time.monotonic() >= self.ready_at

    def wait(self, timeout=None):
        until = time.monotonic() + (timeout or 0)
        if self.ready_at is not None:
            until = min(until, self.ready_at)
        time.sleep(max(0.0, until - time.monotonic()))

    def wait_for_output(self, timeout):
        self.output_waits.append(timeout)

    def get(self, timeout=None):
        assert self.ready(), "get() on a result that is not ready would block"
        self.gets += 1
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class FakeEngine:
    def __init__(self, cluster, rank):
        self.cluster, self.rank = cluster, rank

    def apply_async(self, function, *args):
        self.cluster.applied.append((self.rank, function, args))
        result = self.cluster.results[self.rank]
        result.submit()
        return result


class FakeHost:
    def __init__(self, exit_codes):
        self.exit_codes = exit_codes


class FakeCluster:
    def __init__(self, results, die_after=None, host=None, pid_of=None):
        self.results = {result.rank: result for result in results}
        self.die_after = die_after or {}  # rank -> seconds after the first submission
        self.host = host
        self.pid_of = pid_of or {}
        self.applied = []
        self.signals = []  # (seconds since start, sorted ranks, signal)
        self.replaced = []  # (seconds since start, ranks)
        self.alive_checks = []
        self.started = time.monotonic()

    def engine(self, rank):
        return FakeEngine(self, rank)

    def condition(self, rank):
        """As ``RankCluster.condition``: None while alive, else why not."""
        self.alive_checks.append(rank)
        after = self.die_after.get(rank)
        if after is None or time.monotonic() - self.started < after:
            return None
        code = self.host.exit_codes.get(self.pid_of.get(rank)) if self.host else None
        return f"exited ({describe_exit(code)})"

    def signal(self, ranks, sig):
        self.signals.append((time.monotonic() - self.started, sorted(ranks), sig))
        if sig == signal.SIGINT:
            for rank in ranks:
                self.results[rank].interrupt()

    def replace(self, ranks):
        self.replaced.append((time.monotonic() - self.started, list(ranks)))


@pytest.fixture(autouse=True)
def short_settle(monkeypatch):
    monkeypatch.setattr(RankWork, "settle_seconds", lambda self: SETTLE)


def start(results, ranks=None, timeout=TIMEOUT, grace=GRACE, **cluster_settings):
    cluster = FakeCluster(results, **cluster_settings)
    ranks = sorted(cluster.results) if ranks is None else ranks
    output = make_output(ranks, live=False, show_values=False, silent=True)
    ticks = []
    work = RankWork(cluster, ranks, entry, ("config", 7), timeout, grace, output,
                    on_tick=lambda w: ticks.append((w, time.monotonic() - cluster.started, len(w.pending))))
    return cluster, work, ticks


def test_the_settle_time_past_the_limit_grows_with_it_and_is_capped(monkeypatch):
    monkeypatch.undo()  # the real formula: half a second plus a tenth of the limit, at most 3 s
    work = object.__new__(RankWork)
    for limit, settle in ((0.3, 0.53), (10, 1.5), (25, 3.0), (600, 3.0)):
        work.timeout = limit
        assert work.settle_seconds() == pytest.approx(settle)


def test_every_rank_answers_reports_come_back_in_rank_order():
    # Ranks answer in reverse order; each report is exactly what its rank returned.
    results = [FakeResult(rank, ok(rank, value=rank * 10), answer_after=0.08 - 0.02 * rank,
                          stdout=f"hello from {rank}\n") for rank in range(4)]
    cluster, work, _ = start(results)
    reports = work.wait()
    assert list(reports) == [0, 1, 2, 3]
    assert reports == {rank: ok(rank, value=rank * 10) for rank in range(4)}
    assert not work.failed and not work.timed_out and not work.interrupted and work.replaced == []
    assert cluster.signals == [] and cluster.replaced == []
    # The entry point went to each rank once, with the arguments given.
    assert sorted(cluster.applied, key=lambda a: a[0]) == [(rank, entry, ("config", 7)) for rank in range(4)]
    # Every rank's last output was waited for before its result was taken, and kept.
    assert all(r.output_waits == [dispatch.OUTPUT_GRACE_SECONDS] and r.gets == 1 for r in results)
    assert work.output.texts.stdout == {rank: f"hello from {rank}\n" for rank in range(4)}


def test_only_the_ranks_asked_for_run():
    results = [FakeResult(rank, ok(rank), answer_after=0.0) for rank in range(4)]
    cluster, work, _ = start(results, ranks=[3, 1])
    assert list(work.wait()) == [1, 3]
    assert sorted(rank for rank, _, _ in cluster.applied) == [1, 3]


def test_a_rank_that_answers_while_the_limit_settles_is_not_interrupted():
    results = [FakeResult(0, ok(0), answer_after=0.0), FakeResult(1, ok(1), answer_after=TIMEOUT + SETTLE / 2)]
    cluster, work, _ = start(results)
    assert work.wait() == {0: ok(0), 1: ok(1)}
    assert cluster.signals == [] and not work.timed_out and not work.failed


def test_a_stuck_rank_gets_sigint_and_an_unresponsive_one_is_replaced():
    interrupted_report = {"rank": 1, "ok": False, "error": {"type": "KeyboardInterrupt", "message": "",
                                                            "traceback": "tb", "kind": "interrupted"}}
    results = [
        FakeResult(0, ok(0), answer_after=0.0),
        FakeResult(1, interrupted_report, on_sigint=0.05),  # hung in Python: SIGINT frees it
        FakeResult(2, ok(2), on_sigint=None),  # hung in C: ignores SIGINT
        FakeResult(3, ok(3), answer_after=0.02),
    ]
    cluster, work, _ = start(results)
    reports = work.wait()

    # Step 2: after the limit and the settle time, SIGINT to exactly the ranks still busy, once.
    (sent_at, ranks, sig), = cluster.signals
    assert (ranks, sig) == ([1, 2], signal.SIGINT)
    assert sent_at >= TIMEOUT + SETTLE - 0.01
    # Step 3: the one that did not answer within the grace is replaced, alone, after the grace.
    (replaced_at, replaced), = cluster.replaced
    assert replaced == [2]
    assert replaced_at - sent_at >= GRACE - 0.01

    assert list(reports) == [0, 1, 2, 3]
    assert reports[0] == ok(0) and reports[3] == ok(3)
    assert reports[1] is interrupted_report  # it answered after SIGINT: its own report, not replaced
    error = reports[2]["error"]
    assert reports[2]["rank"] == 2 and reports[2]["ok"] is False
    assert (error["kind"], error["type"]) == ("interrupted", "Unresponsive")
    assert f"within {GRACE:g} s" in error["message"] and "replaced" in error["message"]
    assert work.replaced == [2] and work.timed_out and work.failed and not work.interrupted
    assert results[2].gets == 0  # a result that never landed is never read


def test_ranks_that_all_answer_sigint_are_not_replaced():
    results = [FakeResult(0, ok(0), on_sigint=0.02), FakeResult(1, ok(1), on_sigint=0.1)]
    cluster, work, _ = start(results)
    assert work.wait() == {0: ok(0), 1: ok(1)}
    assert [ranks for _, ranks, _ in cluster.signals] == [[0, 1]]
    assert cluster.replaced == [] and work.replaced == [] and work.timed_out


def test_a_rank_whose_process_dies_is_reported_died(monkeypatch):
    monkeypatch.setattr(dispatch, "LIVENESS_CHECK_SECONDS", 0.05)
    results = [FakeResult(0, ok(0), answer_after=0.0), FakeResult(1, ok(1), answer_after=None)]
    cluster, work, _ = start(results, timeout=5.0, die_after={1: 0.1},
                             host=FakeHost({4242: -9}), pid_of={1: 4242})
    began = time.monotonic()
    reports = work.wait()
    assert time.monotonic() - began < 1.0  # found dead long before the limit
    assert reports[0] == ok(0)
    assert reports[1]["ok"] is False and reports[1]["rank"] == 1
    assert (reports[1]["error"]["kind"], reports[1]["error"]["type"]) == ("died", "ProcessDied")
    assert "SIGKILL (exit code -9)" in reports[1]["error"]["message"]
    assert 0 not in cluster.alive_checks  # only ranks still pending are checked
    assert cluster.signals == [] and cluster.replaced == []
    assert work.failed and not work.timed_out


def test_a_dead_rank_without_a_host_has_no_exit_code(monkeypatch):
    monkeypatch.setattr(dispatch, "LIVENESS_CHECK_SECONDS", 0.05)
    cluster, work, _ = start([FakeResult(0, ok(0))], timeout=5.0, die_after={0: 0.0})
    assert "exit code unknown" in work.wait()[0]["error"]["message"]


def test_on_tick_sees_the_work_while_it_waits():
    results = [FakeResult(0, ok(0), answer_after=0.0), FakeResult(1, ok(1), answer_after=0.25)]
    cluster, work, ticks = start(results, timeout=2.0)
    work.wait()
    assert all(seen is work for seen, _, _ in ticks)
    waiting = [at for _, at, pending in ticks if pending]
    assert len(waiting) >= 2 and waiting[-1] >= 0.15  # called repeatedly while rank 1 was still busy
    assert ticks[-1][2] == 0  # and once more after the last answer
    assert set(work.results) == {0, 1}  # every rank's AsyncResult, finished or not


def test_a_failure_outside_the_runtime_guard_becomes_a_report():
    class RemoteError(Exception):
        def __init__(self, ename, evalue, traceback):
            super().__init__(evalue)
            self.ename, self.evalue, self.traceback = ename, evalue, traceback

    results = [
        FakeResult(0, RemoteError("KeyboardInterrupt", "", ["line one", "line two"]), answer_after=0.0),
        FakeResult(1, RemoteError("ZeroDivisionError", "division by zero", "tb"), answer_after=0.0),
    ]
    _, work, _ = start(results)
    reports = work.wait()
    assert reports[0]["error"] == {"type": "KeyboardInterrupt", "message": "", "traceback": "line one\nline two",
                                   "kind": "interrupted"}
    assert reports[1]["error"] == {"type": "ZeroDivisionError", "message": "division by zero", "traceback": "tb",
                                   "kind": "raised"}
    assert work.failed


def test_work_a_rank_could_not_read_is_not_called_a_result_that_could_not_be_sent_back():
    # ipyparallel reads the work with deserialize_object and sends results with serialize_object.
    read = dispatch._report_from_remote_error(0, _remote("ModuleNotFoundError", "No module named 'helpers'",
                                                         "in unpack_apply_message\n  in deserialize_object"))
    assert read["error"]["message"].startswith("the work could not be read on this rank, so it did not run")
    assert "sys.path.insert" in read["error"]["message"]
    sent = dispatch._report_from_remote_error(1, _remote("TypeError", "cannot pickle '_thread.lock' object",
                                                         "in serialize_object"))
    assert sent["error"]["message"].startswith("the work ran, but its result could not be sent back")


def _remote(ename: str, evalue: str, traceback: str) -> Exception:
    error = Exception(evalue)
    error.ename, error.evalue, error.traceback = ename, evalue, traceback  # type: ignore[attr-defined]
    return error


def test_a_cells_value_is_kept_for_display():
    results = [FakeResult(0, ok(0, display="42"), answer_after=0.0), FakeResult(1, ok(1), answer_after=0.0)]
    _, work, _ = start(results)
    work.wait()
    assert work.output.texts.results == {0: "42", 1: None}


def test_a_kernel_interrupt_goes_to_sigint_at_once_and_restores_the_handler():
    results = [FakeResult(0, ok(0), answer_after=0.0), FakeResult(1, ok(1), on_sigint=0.05),
               FakeResult(2, ok(2), on_sigint=None)]
    before = signal.getsignal(signal.SIGINT)
    cluster = FakeCluster(results)
    output = make_output([0, 1, 2], live=False, show_values=False, silent=True)
    asked = []

    def interrupt_on_second_tick(work):
        asked.append(len(asked))
        if len(asked) == 2:
            raise KeyboardInterrupt

    def on_interrupt():
        asked.append("wind down")
        return 0.05  # a moment to stop on their own; rank 1 and 2 do not

    work = RankWork(cluster, [0, 1, 2], entry, (), 30.0, GRACE, output,
                    on_tick=interrupt_on_second_tick, on_interrupt=on_interrupt)
    began = time.monotonic()
    reports = work.wait()
    assert time.monotonic() - began < 2.0  # nowhere near the 30 s limit
    assert "wind down" in asked
    assert [ranks for _, ranks, _ in cluster.signals] == [[1, 2]]
    assert [ranks for _, ranks in cluster.replaced] == [[2]]
    assert work.interrupted and not work.timed_out and work.replaced == [2]
    assert reports[1] == ok(1) and reports[2]["error"]["type"] == "Unresponsive"
    assert signal.getsignal(signal.SIGINT) is before
