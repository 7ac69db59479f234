"""The task board's text: a rank running a task says so. Pure: hand-made records, no ranks."""

from types import SimpleNamespace

from labkit.views.task_board import board_text


def test_a_rank_running_a_task_is_shown_running():
    records = [SimpleNamespace(index=0, state="running", rank=0), SimpleNamespace(index=1, state="done", rank=1),
               SimpleNamespace(index=2, state="pending", rank=None)]
    rows = board_text(3, [0, 1, 2], records, {0: "ready", 1: "ready", 2: "replaced"}).splitlines()
    assert rows[0] == "tasks: 1 pending, 1 running, 1/3 done"
    assert rows[2].split()[:4] == ["0", "0", "0", "running"]
    assert rows[3].split()[:4] == ["1", "-", "1", "ready"]
    assert rows[4].split()[:4] == ["2", "-", "0", "replaced"]
