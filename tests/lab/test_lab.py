"""The lab core on real processes: 4 gloo ranks on ipyparallel engines."""

import os
import signal
import stat
import threading
import time

import pytest

from labkit import LabNotRunning, MeshError, RankFailure, RankInterrupted, RankTimeout

pytestmark = pytest.mark.lab


def whoami(offset, scale=1):
    import torch.distributed as dist

    return (dist.get_rank() + offset) * scale


def mesh_coordinate():
    from labkit import this_rank

    return tuple(this_rank().mesh.get_coordinate())


def test_run_returns_results_in_rank_order(lab):
    assert lab.run(whoami, 10) == [10, 11, 12, 13]
    assert lab.run(whoami, 0, scale=3) == [0, 3, 6, 9]


def test_state_lives_across_cells(lab):
    lab.run_cell("kept = rank * 100", live=False)
    assert lab.run_cell("kept + 1", live=False) == ["1", "101", "201", "301"]


def test_collectives_work_across_ranks(lab):
    shown = lab.run_cell("t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nt.item()", live=False)
    assert shown == ["6.0"] * 4


def test_cell_output_is_labelled_by_rank(lab, capsys):
    lab.run_cell("print('hello from', rank)", live=False)
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == [f"[rank {r}] hello from {r}" for r in range(4)]


def test_a_line_printed_in_pieces_is_one_labelled_line(lab, capsys):
    # The pieces reach the notebook apart (flushed, a pause between); a piece left open shows at the end.
    lab.run_cell("import time\nprint('abc', end='', flush=True)\ntime.sleep(0.6)\nprint('def')\n"
                 "print('open', rank, end='', flush=True)", live=False)
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == sorted([f"[rank {r}] abcdef" for r in range(4)] + [f"[rank {r}] open {r}" for r in range(4)])


def test_cell_on_some_ranks(lab):
    assert lab.run_cell("rank", ranks=[0, 2], live=False) == ["0", "2"]
    with pytest.raises(ValueError, match="between 0 and 3"):
        lab.run_cell("rank", ranks=[4], live=False)


def test_mesh_coordinates_and_axis_groups(lab):
    spec = lab.mesh(dp=2, tp=2)
    assert lab.run(mesh_coordinate) == [spec.coordinate(r) for r in range(4)]
    sums = lab.run_cell(
        "t = torch.tensor([float(rank)])\ndist.all_reduce(t, group=mesh.get_group('tp'))\nint(t.item())", live=False
    )
    assert sums == ["1", "1", "5", "5"]  # tp groups are [0, 1] and [2, 3]
    assert lab.mesh() is spec


def test_bad_mesh_is_refused_before_anything_runs(lab):
    before = lab.generation
    with pytest.raises(MeshError, match="must multiply to 4"):
        lab.mesh(dp=3)
    assert lab.generation == before


def test_exception_on_one_rank_releases_the_others(lab):
    before = lab.generation
    began = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        lab.run_cell("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('boom')\ndist.all_reduce(x)", live=False)
    # The peers blocked in all_reduce were released at once, not at the 30 s limit.
    assert time.monotonic() - began < 15
    failure = caught.value
    assert set(failure.raised) == {1} and failure.raised[1]["type"] == "ValueError"
    assert set(failure.released) == {0, 2, 3}
    assert "raise ValueError('boom')" in failure.details()
    # What a script's log or pytest shows: the cause with its message, on one line.
    assert str(failure).splitlines()[0].startswith("rank 1 raised ValueError: boom; ranks 0, 2, 3 failed")
    assert lab.generation == before + 1
    assert lab.run_cell("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()", live=False) == ["4.0"] * 4


def test_a_rank_killed_while_four_train_fails_the_run_in_seconds(lab):
    # Four ranks in a ring: only rank 1's neighbours see its sockets close; the others wait on them.
    run = lab.train("ddp", "mlp", steps=100_000, log_every=100_000, background=True)
    while run.table.latest_step is None or run.table.latest_step < 3:
        time.sleep(0.05)
    began = time.monotonic()
    lab.kill(1)
    with pytest.raises(RankFailure):
        run.wait(60)
    assert time.monotonic() - began < 10  # not the 30 s limit
    assert lab.run(lambda: 1) == [1] * 4


def test_hung_rank_is_released_by_the_timeout(lab):
    began = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        lab.run_cell("import time\nif rank == 2:\n    time.sleep(600)\ndist.barrier()", timeout=2, live=False)
    elapsed = time.monotonic() - began
    assert 2 <= elapsed < 2 + 3 + lab.interrupt_grace + 5
    failure = caught.value
    assert set(failure.hung) == {2}
    assert set(failure.released) == {0, 1, 3}
    assert "did not finish within 2 s" in failure.summary()
    assert lab.run(whoami, 0) == [0, 1, 2, 3]


def test_rank_stuck_where_interrupts_cannot_reach_is_replaced(lab):
    pid_before = lab.cluster.pid_of[3]
    code = (
        "import signal, time\n"
        "if rank == 3:\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "    time.sleep(600)\n"
    )
    with pytest.raises(RankTimeout) as caught:
        lab.run_cell(code, timeout=1, live=False)
    assert caught.value.replaced == (3,)
    assert lab.cluster.pid_of[3] != pid_before
    assert "restarted with empty namespaces" in caught.value.details()
    assert lab.run(whoami, 0) == [0, 1, 2, 3]
    assert lab.run_cell("tuple(mesh.get_coordinate())", live=False)[3] == "(1, 1)"


def test_a_rank_that_dies_is_replaced(lab):
    with pytest.raises(RankFailure) as caught:
        lab.run_cell("import os\nif rank == 2:\n    os._exit(3)\ndist.barrier()", live=False)
    assert set(caught.value.died) == {2}
    assert lab.run(whoami, 0) == [0, 1, 2, 3]


def test_kernel_interrupt_stops_the_ranks(lab):
    main_pid = os.getpid()
    threading.Timer(1.0, os.kill, (main_pid, signal.SIGINT)).start()
    began = time.monotonic()
    with pytest.raises(RankInterrupted) as caught:
        lab.run_cell("import time\ntime.sleep(600)", live=False)
    assert time.monotonic() - began < 10
    assert set(caught.value.hung) == {0, 1, 2, 3}
    assert lab.run(whoami, 0) == [0, 1, 2, 3]


def test_start_twice_reuses_the_running_ranks(lab):
    pids = dict(lab.cluster.pid_of)
    assert lab.start() is lab
    assert lab.cluster.pid_of == pids


def test_everything_listens_on_loopback_only(lab):
    addresses = lab.cluster.listening_addresses()
    assert addresses, "the controller, store and gloo must be listening somewhere"
    assert {address for address, _, _ in addresses} == {"127.0.0.1"}
    rank_pids = set(lab.cluster.pid_of.values())
    assert rank_pids & {pid for _, _, pid in addresses}, "gloo's own sockets are among them"


def test_connection_files_are_private(lab):
    workdir = lab.cluster.workdir
    assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
    security = os.path.join(lab.cluster.profile_dir, "security")
    files = os.listdir(security)
    assert any(name.endswith("-client.json") for name in files)
    for name in files:
        assert stat.S_IMODE(os.stat(os.path.join(security, name)).st_mode) == 0o600


def test_status_has_a_row_per_rank(lab):
    status = lab.status()
    assert status.healthy
    assert [row.rank for row in status.ranks] == [0, 1, 2, 3]
    assert {row.pid for row in status.ranks} == set(lab.cluster.pid_of.values())
    assert "4/4 ranks ready" in str(status)


def test_work_needs_a_running_lab():
    from labkit import Lab

    idle = Lab(ranks=2)
    with pytest.raises(LabNotRunning, match="call lab.start"):
        idle.run(whoami, 0)
    assert "stopped" in repr(idle) and not idle.status().running


def test_timeout_must_be_positive_and_finite(lab):
    for absurd in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive, finite number of seconds"):
            lab.run(whoami, 0, timeout=absurd)
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        type(lab)(ranks=2, timeout=float("inf"))
    assert lab.run(whoami, 0) == [0, 1, 2, 3]  # nothing was left half-done


def test_ranks_killed_in_a_collective_are_the_cause_and_explained_once(lab):
    with pytest.raises(RankFailure) as failure:
        lab.run_cell("import os, signal\nif rank in (1, 2):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                     "dist.barrier()", timeout=30)
    error = failure.value
    assert str(error).startswith("ranks 1, 2 died (process exited); ")
    assert "as a consequence of ranks 1, 2" in str(error)
    details = error.details()
    assert details.count("out-of-memory killer") == 1, details  # one explanation for the same death
    assert "--- ranks 1, 2 (died) ---" in details
    assert "(released from a collective: a consequence of ranks 1, 2, not a cause)" in details
    assert "raised" not in str(error)
    assert lab.run(whoami, 0) == [0, 1, 2, 3]
