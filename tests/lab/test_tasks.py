"""The work-stealing queue on real ranks: a fast rank does more, a lost rank's task is done elsewhere
exactly once, a raising task is not repeated, every task is bounded, the lab works afterwards.

Tasks sleep rather than compute so the shares do not depend on how busy the 2 cores are.
"""

import _thread
import os
import signal
import threading
import time

import pytest

from labkit import LabConfigError
from labkit import TaskFailed

from tests.conftest import ipython_shell, wait_gone

pytestmark = pytest.mark.lab


def slow_on_all_but_rank_0(item):
    import time

    from labkit.wire.entry import this_rank

    time.sleep(0.05 if this_rank().rank == 0 else 0.3)
    return item * item


def marks_its_start(item, folder):
    """Notes where each task started and finished: files the test reads to time its fault and count."""
    import os
    import time

    from labkit.wire.entry import this_rank

    here = this_rank().rank
    with open(os.path.join(folder, f"start-{item}-rank{here}-{os.getpid()}"), "w"):
        pass
    time.sleep(0.4)
    with open(os.path.join(folder, f"done-{item}-{os.getpid()}"), "w"):
        pass
    return (item, here, os.getpid())


def _when_started_on(folder, rank, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in os.listdir(folder):
            if name.startswith("start-") and f"-rank{rank}-" in name:
                return int(name.split("-")[-1])
        time.sleep(0.02)
    raise AssertionError(f"no task started on rank {rank}")


def test_an_idle_rank_takes_the_next_task_so_a_fast_rank_does_more(lab):
    results = lab.tasks(slow_on_all_but_rank_0, range(16))
    assert results.values == [item * item for item in range(16)]
    shares = results.per_rank()
    assert sum(shares.values()) == 16
    assert shares[0] > max(count for rank, count in shares.items() if rank != 0)
    assert results.requeued == 0 and not results.events


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_rank_lost_mid_task_is_replaced_and_its_task_completes_exactly_once(lab, tmp_path, fault):
    folder = str(tmp_path)
    items = list(range(10))

    victims = []

    def fault_on_rank_1():
        victims.append(_when_started_on(folder, 1))
        os.kill(victims[0], getattr(signal, fault))

    saboteur = threading.Thread(target=fault_on_rank_1)
    saboteur.start()
    results = lab.tasks(lambda item: marks_its_start(item, folder), items)
    saboteur.join(5)
    victim = victims[0]
    # Every task finished exactly once: one result each, and one "done" mark per item.
    assert [value[0] for value in results.values] == items
    done_marks = [name for name in os.listdir(folder) if name.startswith("done-")]
    assert sorted(int(name.split("-")[1]) for name in done_marks) == items
    lost = [record for record in results.records if record.attempts == 2]
    said = "\n".join(results.events)  # what the queue saw, shown with any failure below
    assert len(lost) == 1 and results.requeued == 1, said
    assert f"task {lost[0].index} requeued: rank 1" in said, said
    # The lost process is gone (a frozen one was killed), and the replacement rejoined the pool.
    assert wait_gone({victim}, 5) == set(), said
    assert "rank 1" in results.events[0] and "rejoined the pool" in results.events[0], said
    # The lab has a full process group again for the next cell.
    assert lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()") == ["4.0"] * 4


def test_a_dead_rank_found_idle_is_replaced_before_the_queue_starts(lab):
    os.kill(lab.status().ranks[2].pid, signal.SIGKILL)
    time.sleep(0.3)
    results = lab.tasks(slow_on_all_but_rank_0, range(4))
    assert results.values == [0, 1, 4, 9] and results.requeued == 0


def test_a_task_that_raises_is_not_repeated_and_the_others_are_kept(lab, tmp_path):
    def fails_on_three(item):
        if item == 3:
            raise ValueError("three is not allowed")
        return item

    with pytest.raises(TaskFailed, match="(?s)1 of 6 tasks failed.*three is not allowed") as caught:
        lab.tasks(fails_on_three, range(6))
    results = caught.value.results
    assert results.values == [0, 1, 2, None, 4, 5]
    assert results.records[3].attempts == 1 and results.records[3].state == "failed"
    assert lab.run(lambda: 1) == [1] * 4


def test_a_task_past_its_time_is_stopped_and_the_queue_goes_on(lab):
    def hangs_on_zero(item):
        import time

        if item == 0:
            time.sleep(3600)
        return item

    began = time.monotonic()
    with pytest.raises(TaskFailed, match="task 0") as caught:
        lab.tasks(hangs_on_zero, range(5), timeout=1.0)
    assert time.monotonic() - began < 30
    assert caught.value.results.values[1:] == [1, 2, 3, 4]
    assert lab.run(lambda: 2) == [2] * 4


def test_no_retries_means_a_lost_rank_fails_its_task(lab, tmp_path):
    folder = str(tmp_path)
    saboteur = threading.Thread(target=lambda: os.kill(_when_started_on(folder, 3), signal.SIGKILL))
    saboteur.start()
    with pytest.raises(TaskFailed, match="retries=0 used up"):
        lab.tasks(lambda item: marks_its_start(item, folder), range(4), retries=0)
    saboteur.join(5)
    assert lab.run(lambda: 3) == [3] * 4


def test_ctrl_c_withdraws_waiting_tasks_and_keeps_finished_ones(lab, tmp_path):
    folder = str(tmp_path)

    def interrupt_after_two_are_done():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(name.startswith("done-") for name in os.listdir(folder)) >= 2:
                break
            time.sleep(0.02)
        time.sleep(0.1)  # let the notebook side collect them
        _thread.interrupt_main()

    interrupter = threading.Thread(target=interrupt_after_two_are_done)
    interrupter.start()
    results = lab.tasks(lambda item: marks_its_start(item, folder), range(40))
    interrupter.join(5)
    assert results.interrupted
    assert 0 < results.done < 40
    assert all(value[0] == index for index, value in enumerate(results.values) if value is not None)
    assert {record.state for record in results.records} <= {"done", "cancelled"}
    assert lab.run(lambda: 4) == [4] * 4


def kills_its_rank_on_zero(item):
    import os
    import signal

    if item == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return item


def test_a_poison_task_is_told_as_lost_not_as_raised(lab, capsys):
    with pytest.raises(TaskFailed) as caught:
        lab.tasks(kills_its_rank_on_zero, range(4), retries=1)
    results = caught.value.results
    assert results.values[1:] == [1, 2, 3] and results.records[0].attempts == 2
    said = capsys.readouterr().out
    assert "raised" not in said  # no task raised: one ended its rank, twice
    assert "1 task(s) lost their rank on every try and were not requeued again" in said
    message = str(caught.value)
    assert "rank None" not in message and "task 0 on rank " in message
    assert results.failures("lost") == [results.records[0]] and results.failures("raised") == []
    assert lab.run(lambda: 6) == [6] * 4


def test_bad_input_is_refused_before_anything_is_sent(lab):
    with pytest.raises(LabConfigError, match="cannot be called"):
        lab.tasks(42, [1, 2])
    with pytest.raises(LabConfigError, match="iterable"):
        lab.tasks(print, 7)
    with pytest.raises(LabConfigError, match="retries"):
        lab.tasks(print, [1], retries=-1)
    assert lab.tasks(print, []).values == []
    import threading as locks

    with pytest.raises(LabConfigError, match="could not be sent"):
        lab.tasks(print, [1, locks.Lock()])
    assert lab.run(lambda: 5) == [5] * 4


def test_the_magics(lab, capsys):
    from IPython.core.error import UsageError

    shell = ipython_shell()
    shell.run_line_magic("load_ext", "labkit")
    magics = shell._labkit_magics
    magics.lab = lab
    shell.user_ns.update(square=lambda item: item * item, numbers=[1, 2, 3])
    results = shell.run_line_magic("lab", "tasks square numbers --timeout 30")
    assert results.values == [1, 4, 9]
    assert "3/3 tasks done" in capsys.readouterr().out
    with pytest.raises(UsageError, match="nowhere is not one"):
        shell.run_line_magic("lab", "tasks square nowhere")
    report = shell.run_line_magic("lab", "ensemble --model mlp --members 2 --steps 3")
    assert len(report.members) == 2
    magics.lab = None
    shell.run_line_magic("unload_ext", "labkit")
