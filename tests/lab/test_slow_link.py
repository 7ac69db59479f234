"""The simulated slow link (``lab.link``) on 4 real gloo ranks: cells, DDP, instruments, healing, magics.

Times are checked against the link model (``labkit.spec.link``) as lower bounds only: the added time
is at least what the model predicts, whatever else the (noisy, shared) machine does.
"""

import statistics

import pytest

from labkit.spec.errors import LabConfigError
from labkit.spec.link import LinkSpec
from labkit.wire.entry import this_rank

from tests.conftest import ipython_shell, wait_gone

pytestmark = pytest.mark.lab

MLP = dict(dims=(16, 64, 64, 64, 16))
SMALL_RUN = dict(model_settings=MLP, global_batch=16, log_every=100)


@pytest.fixture(autouse=True)
def link_off_afterwards(lab):
    yield
    if lab.running:
        lab.link("off")


def time_collective(kind: str, numel: int, repeats: int = 1) -> float:
    """Rank side: seconds per ``kind`` of ``numel`` float32 over the world group (as a cell would call it)."""
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    world, rank = dist.get_world_size(), this_rank().rank
    whole, part = torch.ones(numel), torch.ones(numel // world)
    run = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
        "broadcast": lambda: dist.broadcast(whole, src=0),
        "send": lambda: dist.send(whole, 1) if rank == 0 else dist.recv(whole, 0) if rank == 1 else None,
        # DTensor's way: a functional collective, which finds the group by its name
        "functional": lambda: funcol.all_reduce(whole, "sum", dist.group.WORLD).wait(),
    }[kind]
    if kind == "functional":
        run()  # its first call sets itself up for seconds, which would hide the link
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - began) / repeats


def link_on_rank():
    """Rank side: this rank's link setting, and whether the world group is the lab's handle (which crosses
    the link while one is set)."""
    import torch.distributed as dist

    from labkit.rank.instruments.timed_group import TimedGroup

    return this_rank().link.spec, isinstance(dist.group.WORLD, TimedGroup)


def issue_without_waiting() -> tuple:
    """Rank side: how long issuing an async all-reduce takes, whether it is done at once, the wait."""
    import time

    import torch
    import torch.distributed as dist

    began = time.perf_counter()
    work = dist.all_reduce(torch.ones(4), async_op=True)
    issued = time.perf_counter() - began
    done_at_once = work.is_completed()
    work.wait()
    return issued, done_at_once, time.perf_counter() - began


def predicted_per_step(result: dict, link: LinkSpec, world: int) -> list[float]:
    """For each step the run kept a timeline of: what the link adds to its collectives, by the model."""
    return [sum(link.seconds(kind, nbytes, world) for kind, nbytes, _, _ in entry["collectives"])
            for entry in result["timeline"]]


def test_an_all_reduce_in_a_cell_pays_the_latency_of_every_round(lab):
    link = lab.link(latency="50ms")
    predicted = link.seconds("all_reduce", 4, 4)
    assert predicted == pytest.approx(0.3)  # 2(n-1) = 6 rounds of 50 ms
    code = ("import time\nt = torch.ones(1)\nbegan = time.perf_counter()\ndist.all_reduce(t)\n"
            "(time.perf_counter() - began, t.item())")
    for shown in lab.run_cell(code):
        seconds, total = eval(shown)
        assert seconds >= predicted and total == 4.0
    assert lab.run(link_on_rank) == [(link, True)] * 4
    assert min(lab.run(time_collective, "functional", 4)) >= predicted
    # Issuing does not wait for the link: the work completes later (DDP overlaps this with backward).
    for issued, done_at_once, waited in lab.run(issue_without_waiting):
        assert not done_at_once and issued < predicted <= waited


def test_the_bandwidth_term_grows_with_the_bytes(lab):
    link = lab.link("100Mbit")
    for kind, numel in (("all_reduce", 10**6), ("all_gather", 10**6), ("broadcast", 250_000), ("send", 250_000)):
        predicted = link.seconds(kind, 4 * numel, 4)
        # all-reduce of 4 MB: 1.5 x 4 MB x 8 / 100 Mbit/s = 0.48 s; all-gather 0.24 s; broadcast of 1 MB
        # over a 2-level tree 0.16 s; a 1 MB message 0.08 s
        assert predicted == pytest.approx({"all_reduce": 0.48, "all_gather": 0.24, "broadcast": 0.16,
                                           "send": 0.08}[kind])
        seconds = lab.run(time_collective, kind, numel)
        ranks = [0, 1] if kind == "send" else range(4)
        assert all(seconds[rank] >= predicted for rank in ranks), (kind, predicted, seconds)


def test_ddp_training_communication_grows_by_the_prediction(lab):
    fast = lab.train("ddp", "mlp", steps=5, **SMALL_RUN)
    link = lab.link(latency="50ms")
    slow = lab.train("ddp", "mlp", steps=5, **SMALL_RUN)
    assert slow.losses == fast.losses  # the same training, only later
    for rank, (before, after) in enumerate(zip(fast.results, slow.results)):
        predicted = predicted_per_step(after, link, 4)[1:]  # the steps the report calls steady
        # One bucket a step: 6 rounds of 50 ms (step 1 also broadcasts DDP's rebuilt bucket order, 2 x 2 rounds).
        assert predicted[-1] == pytest.approx(0.3) and predicted[0] == pytest.approx(0.5), predicted
        rows = after["rows"][1:]
        for row, added in zip(rows, predicted):
            assert sum(row["comm"].values()) >= added and row["seconds"] >= added
        grown = statistics.fmean(sum(r["comm"].values()) for r in rows) - statistics.fmean(
            sum(r["comm"].values()) for r in before["rows"][1:])
        exposed = statistics.fmean(r["exposed_comm"] for r in rows) - statistics.fmean(
            r["exposed_comm"] for r in before["rows"][1:])
        assert grown >= 0.8 * statistics.fmean(predicted), (rank, grown, predicted)
        assert exposed >= 0.8 * statistics.fmean(predicted), (rank, exposed, predicted)  # waiting, not computing


def test_runs_without_instruments_cross_the_link_too(lab):
    lab.link(latency="50ms")
    pid = lab.cluster.pid_of[3]
    lab.kill(3)  # the next call forms a fresh process group: no mesh of it is built yet
    assert wait_gone([pid]) == set()
    report = lab.train("ddp", "mlp", steps=4, instruments=False, **SMALL_RUN)
    assert all(result["rows"] == [] for result in report.results)
    assert all(seconds >= 0.3 for seconds in report.step_seconds[1:])  # one all-reduce a step, 6 rounds
    # The plain run's mesh took the world group first; a measured run on the same group still measures it.
    measured = lab.train("ddp", "mlp", steps=3, **SMALL_RUN)
    assert all(len(result["rows"]) == 3 for result in measured.results)  # rows to check, on every rank
    assert all(sum(row["comm"].values()) >= 0.3 for result in measured.results for row in result["rows"][1:])


def test_off_restores_the_fast_path(lab):
    lab.link(latency="50ms")
    assert lab.link("off") is None and lab.link() is None
    assert lab.run(link_on_rank) == [(None, True)] * 4  # the world group's handle, with no link to cross
    seconds = lab.run(time_collective, "all_reduce", 1, 5)
    assert max(seconds) < 0.3  # far below the 300 ms a link of 50 ms adds to each


def test_a_replaced_rank_gets_the_same_link(lab):
    link = lab.link("1Gbit", "50ms")
    pid = lab.cluster.pid_of[1]
    lab.kill(1)
    assert wait_gone([pid]) == set()  # dead before the next call looks
    assert lab.run(link_on_rank) == [(link, True)] * 4  # the call healed the lab first
    assert lab.cluster.pid_of[1] != pid
    seconds = lab.run(time_collective, "all_reduce", 1)
    assert min(seconds) >= link.seconds("all_reduce", 4, 4)
    assert "simulated link 1 Gbit/s, 50 ms latency" in str(lab.status())


def test_bad_input_is_refused_and_nothing_changes(lab):
    link = lab.link(latency="5ms")
    generation = lab.generation
    for bandwidth, latency in [("fast", ...), ("-5Mbit", "20ms"), ("0Mbit", ...), ("100Mbit", "20")]:
        with pytest.raises(LabConfigError, match="100Mbit|20ms"):
            lab.link(bandwidth, latency)
    assert lab.link() == link and lab.generation == generation
    assert lab.run(link_on_rank) == [(link, True)] * 4


def test_the_magic_sets_shows_and_clears_the_link(lab, capsys):
    from IPython.core.error import UsageError

    shell = ipython_shell()
    loaded_here = "labkit" not in shell.extension_manager.loaded
    shell.run_line_magic("load_ext", "labkit")
    magics = shell.magics_manager.registry["LabMagics"]
    held = magics.lab
    magics.lab = lab
    try:
        shell.run_line_magic("lab", "link 100 Mbit/s 20ms")
        said = capsys.readouterr().out
        assert "simulated link: 100 Mbit/s, 20 ms latency; an all-reduce of 1.0 MB over 4 ranks" in said
        assert lab.link() == LinkSpec(1e8, 0.02)
        shell.run_line_magic("lab", "link")
        assert "100 Mbit/s, 20 ms latency" in capsys.readouterr().out
        assert "simulated link 100 Mbit/s, 20 ms latency" in str(shell.run_line_magic("lab", "status"))
        with pytest.raises(UsageError, match="'20' needs its unit"):
            shell.run_line_magic("lab", "link 100Mbit 20")
        with pytest.raises(UsageError, match="write the bandwidth with its unit"):
            shell.run_line_magic("lab", "link fast")
        assert lab.link() == LinkSpec(1e8, 0.02)
        shell.run_line_magic("lab", "link off")
        assert capsys.readouterr().out.splitlines() == [
            "simulated link removed: collectives run at this machine's speed again"]
        assert lab.link() is None
    finally:
        magics.lab = held  # the shell is shared: unloading it must not stop this module's lab
        if loaded_here:
            shell.run_line_magic("unload_ext", "labkit")


def test_the_link_outlives_a_restart_which_says_what_it_waits_on(lab, capsys):
    link = lab.link(latency="500ms")  # the new group's check is an all-reduce of 6 rounds: 3 s over this link
    capsys.readouterr()
    lab.restart()
    assert ("waiting for the ranks to check their new process group over the simulated link (unlimited bandwidth, "
            "500 ms latency) ...") in capsys.readouterr().out.splitlines()
    assert lab.link() == link and lab.run(link_on_rank) == [(link, True)] * 4
