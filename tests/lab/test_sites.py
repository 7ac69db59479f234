"""Sites on this machine: join commands over HTTPS run as real processes, ranks through the line.

Each site here is ``python -m labkit join <https token> --ranks N --name NAME``, run as a subprocess
on this machine's loopback, exactly the program a machine behind NAT runs: its engines reach the
lab's controller only through its one TLS connection to the lab's hub. The namespace test
(``test_sites_netns.py``) adds the firewall, the proxy and the cut link; this file proves what the
line carries: cells and training on a site's ranks, the task queue across sites with a site frozen,
and DiLoCo fused across sites (equal to one process, and within 5% of one machine after a site is
killed mid-run and joins again).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from labkit import Lab
from labkit.spec.train_config import resolve
from labkit.torch_support.trainable import declared_trainable

pytestmark = pytest.mark.lab

LIMIT = 300.0


class Site:
    """One join command, run as its own process group (killed, with everything it started, at the end)."""

    def __init__(self, command: str, name: str, ranks: int, log_dir) -> None:
        self.name = name
        self.log = log_dir / f"site-{name}.log"
        argv = [*shlex.split(command.replace("python", sys.executable, 1)), "--ranks", str(ranks), "--name", name]
        self.process = subprocess.Popen(argv, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                        start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def family(self) -> list[psutil.Process]:
        try:
            agent = psutil.Process(self.process.pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def output(self) -> str:
        return self.log.read_text()

    def end(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture(scope="module")
def lab():
    with Lab(ranks=3, threads_per_rank=1, timeout=LIMIT, start_timeout=90) as made:
        yield made


@pytest.fixture
def sites(lab, tmp_path):
    """Starts sites on the lab's line; every one is ended after the test, whatever happened."""
    started: list[Site] = []
    command = lab.join_command(https=True, address="127.0.0.1", port=0)

    def start(name: str, ranks: int = 1) -> Site:
        site = Site(command, name, ranks, tmp_path)
        started.append(site)
        return site

    start.command = command  # type: ignore[attr-defined]
    yield start
    for site in started:
        site.end()


def all_reduce_ones() -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    return float(tensor[0])


def test_a_site_runs_cells_and_trains_through_its_line_and_listens_on_loopback_only(lab, sites):
    home = sites("home", ranks=2)
    assert lab.wait_for_sites(names=["home"], timeout=60) == ["home"]
    assert "home:" in repr(lab.sites) and "2/2 engines, connected" in repr(lab.sites)
    site = lab.site("home")
    assert site.run_cell("(rank, world_size)") == ["(0, 2)", "(1, 2)"]
    assert site.run(all_reduce_ones) == [2.0, 2.0]  # the site's own group, on its own ranks
    report = site.train("ddp", steps=3, global_batch=8)
    assert report.steps_done == 3 and report.comm_bytes_per_step["all_reduce"] > 0
    assert lab.run_cell("world_size") == ["3", "3", "3"]  # the lab's own ranks are untouched
    listening = {(c.laddr.ip, c.laddr.port) for p in home.family() for c in p.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening and all(ip == "127.0.0.1" for ip, _ in listening), listening
    # The hub reached the site's store through the line: a stop request gets there (a run stops early).
    run = site.train("ddp", steps=10_000, global_batch=8, background=True)
    time.sleep(2)
    run.stop()
    assert run.wait().stopped_early


def test_tasks_share_out_over_sites_and_a_frozen_site_loses_no_task(lab, sites):
    frozen, steady = sites("frozen"), sites("steady")
    lab.wait_for_sites(names=["frozen", "steady"], timeout=60)

    def square(item):
        import time as clock

        clock.sleep(0.15)
        return item * item

    lab.site("frozen"), lab.site("steady")  # their groups formed before the clock starts
    import threading

    def freeze_and_thaw():
        time.sleep(1.0)
        frozen.signal(signal.SIGSTOP)
        time.sleep(3.0)  # longer than the controller waits for heartbeats (about 2 s)
        frozen.signal(signal.SIGCONT)

    thaw = threading.Thread(target=freeze_and_thaw, daemon=True)
    thaw.start()
    results = lab.tasks(square, range(200), sites=["frozen", "steady"], live=False)
    thaw.join()
    assert results.values == [item * item for item in range(200)]  # every task once, in order
    done_by = results.per_rank()
    assert done_by.get("steady:0", 0) > 0 and sum(done_by.values()) == 200
    assert any("rank frozen:0" in event and "dropped" in event for event in results.events), results.events
    # The frozen site, thawed, has its controller-dropped rank replaced by its agent and works again.
    assert lab.site("frozen").run_cell("rank") == ["0"]
    assert steady.process.poll() is None and frozen.process.poll() is None


def test_diloco_across_two_sites_equals_one_process_diloco(lab, sites):
    sites("left"), sites("right")
    lab.wait_for_sites(names=["left", "right"], timeout=60)
    report = lab.train("diloco", steps=10, inner_steps=5, global_batch=8, sites=["left", "right"], wire="fp32",
                       verify=True)
    assert [record.used for record in report.rounds] == [["left", "right"]] * 2
    assert report.equivalent and report.verify_difference < 1e-5, report
    assert report.hub_bytes_per_round == 2 * 2 * report.model_bytes  # 2 x sites x model, in float32


def heldout_loss(state: dict, model: str) -> float:
    """The zoo model with ``state`` on batches no run trained on (a fixed held-out range of steps)."""
    config = resolve(3, strategy="diloco", mesh={"replica": 3}, model=model, global_batch=24)
    trainable = declared_trainable(config)
    network = trainable.build(config.seed, "cpu")
    network.load_state_dict({name: torch.as_tensor(value) for name, value in state.items()})
    with torch.no_grad():
        losses = [float(trainable.loss(trainable.call(network, batch), batch))
                  for batch in (trainable.batch(10_000 + step, 64) for step in range(16))]
    return sum(losses) / len(losses)


def test_diloco_across_three_sites_with_one_killed_mid_round_ends_within_5_percent_of_one_machine(lab, sites):
    # The character GPT of the zoo: its held-out loss levels off by 200-300 steps, so two runs of the same data
    # are compared where they have both learnt what they can (the MLP's loss still falls fast there).
    steps, inner, settings = 300, 10, dict(model="gpt", lr=3e-3, global_batch=24)
    one_machine = lab.train("diloco", steps=steps, inner_steps=inner, mesh={"replica": 3}, **settings)
    reference = heldout_loss(lab.model_state(), "gpt")
    names = ["east", "west", "north"]
    started = {name: sites(name, ranks=2) for name in names}
    lab.wait_for_sites(names=names, timeout=60)
    run = lab.train("diloco", steps=steps, inner_steps=inner, sites=names, background=True, **settings)
    deadline = time.monotonic() + 120
    while run.progress()["round"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    killed_in = run.progress()["round"]
    started["north"].signal(signal.SIGKILL)  # the whole site: its join command and its ranks
    started["north"].process.wait(10)
    time.sleep(1.0)
    again = sites("north", ranks=2)  # the machine runs its join command again
    report = run.wait(LIMIT)
    left_out = [record for record in report.rounds if record.left_out]
    assert left_out and left_out[0].round == killed_in and left_out[0].left_out == ["north"], report
    rejoined = [record.round for record in report.rounds if "north" in record.used and record.round > killed_in]
    assert rejoined, f"north never came back: {report}"
    shares = [share for record in report.rounds for name, share in record.shares.items() if name in record.used]
    assert sorted(shares) == [(block, part) for block in range(steps // inner) for part in range(3)]  # each once
    final = heldout_loss(report.model_state(), "gpt")
    print(f"held-out loss: sites {final:.4f}, one machine {reference:.4f} ({final / reference - 1:+.1%}); "
          f"north left out in round {killed_in}, back in round {rejoined[0]}; {len(report.rounds)} rounds")
    assert abs(final - reference) <= 0.05 * reference, (final, reference, one_machine.losses[-1])
    assert again.process.poll() is None
