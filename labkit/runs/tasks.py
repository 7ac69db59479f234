"""A work-stealing queue over the lab's ranks: independent tasks, each done exactly once.

``run_tasks(session, fn, items)`` sends ``fn(item)`` for every item through
ipyparallel's load-balanced view. Its scheduler gives an engine one task at a
time (``TaskScheduler.hwm = 1``), so a rank takes the next task when it becomes
idle and a fast rank does more: work stealing by the controller's own
scheduler, not one written here.

What this module adds is what the scheduler leaves to its caller:

- **A rank that dies, freezes or is dropped** while running a task: the lab sees
  it within a fraction of a second (the process host reports the exit; a frozen
  process is in state "stopped"), kills it if it is still there, starts a fresh
  process in its place (it registers as a new engine and joins the pool) and
  sends the task again. ipyparallel would also resubmit it (``retries``), but
  only after two seconds of missed heartbeats and a fixed five-second grace;
  and it would resubmit a task that raised, too, which must not be repeated.
- **Exactly once:** every item has one current attempt. A replaced attempt's
  rank is dead (killed if it was frozen), so its result can never arrive; the
  scheduler's late "engine died" reply for it is recognised and dropped.
- **A task that raises** is not repeated: its error is kept, the others go on,
  and ``TaskFailed`` is raised at the end with every result that was made.
- **Bounded:** each task has ``timeout`` seconds; past it the rank is
  interrupted (SIGINT), then replaced if it does not stop. Ctrl-C stops the
  queue: waiting tasks are withdrawn, running ones interrupted, and what was
  finished is returned.

Afterwards, if a rank was replaced, the process group is rebuilt so the next
cell has one (the other ranks keep their variables).

Sites (machines that joined over HTTPS, ``runs.task_pools.SitePool``) add their ranks to the pool:
their tasks cross their line; a task's lease is its engine's registration, renewed by its
heartbeats through the line, so a site cut off loses its engines within the controller's
heartbeat limit and their tasks are requeued elsewhere; the site's fresh engines rejoin the
pool when its line is back. The queue never waits for a site.
"""

from __future__ import annotations

import pickle
import signal
import time
from typing import TYPE_CHECKING

from labkit.runs.sources import notebook_sources
from labkit.runs.task_pools import RankPool, SitePool, Worker
from labkit.runs.task_results import LOST, TaskFailed, TaskRecord, TaskResults, on_rank
from labkit.spec.bounds import MAX_TASK_RETRIES, check_whole
from labkit.spec.errors import LabConfigError, LabError, format_ranks
from labkit.views.task_board import TaskBoard
from labkit.wire import entry

if TYPE_CHECKING:
    from ipyparallel import AsyncResult, Client, LoadBalancedView

    from labkit.session import Session  # a layer above the runs it drives

POLL_SECONDS = 0.05


def _check(fn, items, retries) -> list:
    if not callable(fn):
        raise LabConfigError(f"lab.tasks runs a function on each item: got {fn!r}, which cannot be called")
    try:
        items = list(items)
    except TypeError:
        raise LabConfigError(f"lab.tasks needs a list (or any iterable) of items, got {items!r}") from None
    check_whole("retries (how often a task may be requeued after its rank is lost)", retries, MAX_TASK_RETRIES,
                "retries=2", least=0)
    return items


class TaskQueue:
    """One ``lab.tasks`` call: submits, watches the ranks, requeues, collects."""

    def __init__(self, session: Session, fn, items, timeout: float, retries: int, live: bool | None,
                 sites: dict[str, Session] | None = None) -> None:
        self.session = session
        self.pools: list[RankPool] = [RankPool(session),
                                      *(SitePool(name, site) for name, site in (sites or {}).items())]
        self.worker_of: dict[int, Worker] = {}  # engine id -> the worker (rank, or site:rank) it is
        self.fn = fn
        self.items = items
        self.timeout = timeout
        self.retries = retries
        self.sources = notebook_sources(fn)
        self.records = [TaskRecord(index) for index in range(len(items))]
        self.attempt: dict[int, AsyncResult] = {}  # item index -> its current attempt
        self.events: list[str] = []
        self.interrupted_at: dict[Worker, float] = {}  # worker -> when a timed-out task was interrupted
        # Engines of replaced ranks -> (worker, why): a task seen starting there later was lost with it.
        self.dead_engines: dict[int, tuple[Worker, str]] = {}
        self.board = TaskBoard(len(items), self._workers(), live=live)
        self.view: LoadBalancedView | None = None

    # -- status, for session.claim ------------------------------------------

    done = False

    def status(self) -> str:
        return f"a task queue, {sum(r.state == 'done' for r in self.records)}/{len(self.records)} done"

    def stop(self) -> None:  # the lab is stopping: nothing more to do here
        self.done = True

    def finished(self, timeout: float | None = None) -> bool:
        return True

    # -- the queue -----------------------------------------------------------

    def _client(self) -> Client:
        client = self.pools[0].cluster.client
        assert client is not None, "the lab runs (the session's ready() said so): it has its client"
        return client

    def _workers(self) -> list[Worker]:
        return [worker for pool in self.pools for worker in pool.workers()]

    def _wait_for_retired_engines(self, seconds: float = 5.0) -> None:
        """The scheduler sends work to every engine the controller still lists. A rank replaced just
        before (it died while idle) is listed until its heartbeats are missed (about 2 s): a task
        sent to it would wait out ipyparallel's grace before coming back. So wait for it to go."""
        deadline = time.monotonic() + seconds
        retired = set().union(*(pool.cluster.retired_engines for pool in self.pools))
        while retired & set(self._client().ids) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)

    def _make_view(self) -> None:
        """A load-balanced view over the ranks' engines only: an engine that registered but is not a rank
        yet (a replacement being set up, a machine that joined) has no runtime to run a task."""
        self.worker_of = {engine: worker for pool in self.pools for engine, worker in pool.engines().items()}
        self.view = self._client().load_balanced_view(targets=sorted(self.worker_of))
        self.view.retries = 0  # requeueing is ours: only after a lost rank, never after a raise

    def run(self) -> TaskResults:
        began = time.monotonic()
        interrupted = False
        try:
            self._wait_for_retired_engines()
            self._make_view()
            try:
                for record in self.records:
                    self._submit(record)
            except (TypeError, AttributeError, pickle.PicklingError) as error:
                self._withdraw()
                raise LabConfigError(
                    f"task {record.index} could not be sent to the ranks: {error}. A function and its item travel "
                    "pickled: pass plain data, and make locks, open files or clients inside the function") from None
            while any(record.state in ("pending", "running") for record in self.records):
                self._collect()
                self._watch_ranks()
                self.board.show(self.records, self._rank_states())
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            interrupted = True
            self._withdraw()
        finally:
            self.done = True
            self.board.finish()
        results = TaskResults(self.records, self.events, time.monotonic() - began, interrupted)
        return results

    def _submit(self, record: TaskRecord) -> None:
        record.attempts += 1
        record.state, record.rank, record.started = "pending", None, None
        assert self.view is not None, "run() makes the view before it submits"
        self.attempt[record.index] = self.view.apply_async(
            entry.run_task, self.fn, self.items[record.index], self.sources, self.timeout)

    def _rank_of_engine(self, engine_id) -> Worker | None:
        return self.worker_of.get(engine_id)

    def _collect(self) -> None:
        for record in self.records:
            if record.state not in ("pending", "running"):
                continue
            result = self.attempt[record.index]
            if not result.ready():
                engine_id = result.metadata.get("engine_id")
                if engine_id in self.dead_engines:
                    # It started on a rank that died so soon after that its start was only heard now.
                    rank, why = self.dead_engines[engine_id]
                    record.rank = rank
                    self._requeue(record, f"rank {rank} {why} while running it")
                    continue
                started_on = self._rank_of_engine(engine_id) if engine_id is not None else None
                if started_on is not None and record.state == "pending":
                    record.state, record.rank, record.started = "running", started_on, time.monotonic()
                continue
            try:
                report = result.get(0)
            except Exception as error:  # noqa: BLE001 - the scheduler's reply for an engine that went
                if type(error).__name__ == "EngineError" or "EngineError" in str(getattr(error, "ename", "")):
                    engine_id = result.metadata.get("engine_id")
                    if engine_id in self.dead_engines:  # the rank it was sent to, if it is known
                        record.rank = self.dead_engines[engine_id][0]
                    self._requeue(record, "its rank's engine was unregistered by the controller")
                    continue
                record.state, record.error = "failed", {"type": type(error).__name__, "message": str(error),
                                                         "traceback": ""}
                continue
            ran_on = self._rank_of_engine(result.metadata.get("engine_id"))  # a site's rank reports its own number
            record.rank = ran_on if ran_on is not None else report.get("rank", record.rank)
            record.seconds = report.get("seconds")
            record.output = (result.stdout or "") + (result.stderr or "")
            if report.get("ok"):
                record.state, record.value = "done", report.get("value")
            else:
                record.state, record.error = "failed", report["error"]

    def _requeue(self, record: TaskRecord, why: str) -> None:
        if record.attempts > self.retries:
            record.state = "failed"
            record.error = {"type": LOST, "message": f"{why}; not requeued: retries={self.retries} used up",
                            "traceback": ""}
            return
        self.events.append(f"task {record.index} requeued: {why}")
        self._submit(record)

    def _rank_states(self) -> dict[Worker, str]:
        states: dict[Worker, str] = {}
        for pool in self.pools:
            for rank in pool.cluster.ranks:
                states[pool.worker(rank)] = ("lost" if rank in pool.down else
                                             "replaced" if rank in pool.replaced else "ready")
        return states

    def _place(self, worker: Worker) -> tuple[RankPool, int]:
        for pool in self.pools:
            for rank in pool.cluster.ranks:
                if pool.worker(rank) == worker:
                    return pool, rank
        raise KeyError(worker)

    def _watch_ranks(self) -> None:
        """Replace a rank that cannot work, and requeue the task it was running."""
        now = time.monotonic()
        broken: dict[Worker, str] = {}
        for pool in self.pools:
            broken.update({pool.worker(rank): why for rank, why in pool.broken().items()})
        for record in self.records:
            # Past its time: interrupt the rank once, then replace it if it does not stop.
            held_by = record.rank  # a running task's rank is known
            if record.state == "running" and held_by is not None and record.started is not None \
                    and now - record.started > self.timeout:
                first = self.interrupted_at.setdefault(held_by, now)
                if first == now:
                    pool, rank = self._place(held_by)
                    pool.signal([rank], signal.SIGINT)
                elif now - first > self.session.interrupt_grace:
                    broken.setdefault(held_by, f"did not stop within {self.session.interrupt_grace:g} s "
                                                   f"of an interrupt after the task's {self.timeout:g} s")
        back = {pool.worker(rank) for pool in self.pools for rank in pool.retry()}
        if not broken:
            if back:
                self._make_view()
                self.events.append(f"{format_workers(back)} rejoined the pool (fresh engines of their site)")
            return
        lost = [(record, held_by) for record in self.records
                if record.state == "running" and (held_by := record.rank) is not None and held_by in broken]
        for engine, worker in self.worker_of.items():
            if worker in broken:
                self.dead_engines[engine] = (worker, broken[worker])
        for pool in self.pools:  # kills what is left of them first (a frozen one too)
            ranks = [rank for rank in pool.cluster.ranks if pool.worker(rank) in broken]
            if ranks:
                back |= {pool.worker(rank) for rank in pool.repair(ranks)}
        self._make_view()  # tasks sent from now on (the requeued ones first) may go to the replacements too
        for worker, condition in sorted(broken.items(), key=lambda item: str(item[0])):
            done = "replaced, and it rejoined the pool" if worker in back else \
                "left out until its site's fresh engines come"
            self.events.append(f"{format_workers([worker])} {condition}: {done}")
            self.interrupted_at.pop(worker, None)
        for record, held_by in lost:
            if record.started is not None and now - record.started > self.timeout:
                record.state = "failed"
                record.error = {"type": "TimeoutError", "message": f"task took more than {self.timeout:g} s",
                                "traceback": ""}
            else:
                self._requeue(record, f"rank {held_by} {broken[held_by]} while running it")

    def _withdraw(self) -> None:
        """Ctrl-C: withdraw waiting tasks, interrupt running ones, keep what finished."""
        waiting = [self.attempt[r.index] for r in self.records if r.state == "pending" and r.index in self.attempt]
        running = {r.rank for r in self.records if r.state == "running" and r.rank is not None}
        try:
            if self.view is not None and waiting:
                self.view.abort(jobs=[msg_id for result in waiting for msg_id in result.msg_ids], block=False)
        except Exception:  # noqa: BLE001 - already started or gone: such a task is interrupted below
            pass
        for worker in running:
            pool, rank = self._place(worker)
            pool.signal([rank], signal.SIGINT)
        deadline = time.monotonic() + self.session.interrupt_grace
        while time.monotonic() < deadline and any(
                not self.attempt[r.index].ready() for r in self.records if r.state == "running"):
            time.sleep(POLL_SECONDS)
        for record in self.records:
            if record.index not in self.attempt:
                record.state = "cancelled"  # never sent
        self._collect()
        for record in self.records:
            if record.state == "failed" and (record.error or {}).get("type") in ("KeyboardInterrupt", "TaskAborted"):
                record.state, record.error = "cancelled", None  # stopped by the user, not broken
        stuck = {r.rank for r in self.records if r.state == "running" and r.rank is not None}
        for pool in self.pools:
            ranks = [rank for rank in pool.cluster.ranks if pool.worker(rank) in stuck]
            if ranks:
                pool.repair(ranks)
        for record in self.records:
            if record.state in ("pending", "running"):
                record.state = "cancelled"


def format_workers(workers) -> str:
    """'rank 2', 'ranks 0 and 3', 'rank home:1': a site's ranks are named with their site."""
    return format_ranks(sorted(workers, key=str)) if all(isinstance(w, int) for w in workers) else \
        ", ".join(f"rank {worker}" for worker in sorted(workers, key=str))


def run_tasks(session: Session, fn, items, timeout: float | None = None, retries: int | None = None,
              live: bool | None = None, sites: dict[str, Session] | None = None) -> TaskResults:
    """Run ``fn(item)`` for every item on whichever rank is idle (the lab's, and ``sites``' ranks: their
    sessions by name); see the module docstring."""
    sessions = [session, *(sites or {}).values()]
    retries = sum(each.world_size for each in sessions) if retries is None else retries
    items = _check(fn, items, retries)
    limit = session.limit(timeout)
    for each in sessions:
        each.ready()  # broken ranks replaced first: every rank starts in the pool
    queue = TaskQueue(session, fn, items, limit, retries, live, sites)
    claimed = []
    try:
        for each in sessions:
            each.claim(queue)
            claimed.append(each)
        results = queue.run()
    finally:
        for each in claimed:
            each.release(queue)
        # A replaced rank is not in the process groups yet: its world is formed anew. A task that
        # raised or was stopped leaves the groups as they are (tasks do not wait for each other).
        for pool in queue.pools:
            pool.finish()
    print(results.summary(), flush=True)
    failed = [record for record in results.records if record.state == "failed"]
    if failed:
        first = failed[0]
        error = first.error or {}  # a failed task has its error
        detail = error.get("traceback") or f"{error['type']}: {error['message']}"
        raise TaskFailed(f"{len(failed)} of {len(results)} tasks failed (the others' results are in "
                         f"error.results); task {first.index} {on_rank(first)}:\n{detail}", results)
    return results
