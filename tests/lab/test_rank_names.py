"""Tab completion from the ranks' names and ``%lab who``, through IPython's own shell on a real 2-rank lab."""

import os
import signal
import statistics
import time

import pytest
from IPython.core.completer import provisionalcompleter
from IPython.core.error import UsageError

from labkit import LabBusy
from tests.conftest import lab_shell

pytestmark = pytest.mark.lab

RANK_CELL = """\
only_on_ranks_value = 1
class Box:
    reads = 0
    def __init__(self):
        self.alpha = 1
        self.alpine = 2
    @property
    def costly(self):
        Box.reads += 1
        return self
box = Box()
same = torch.ones(2, 3)
shaped = torch.zeros(rank + 1, 4)
if rank == 1:
    lonely_on_one = 5
"""


@pytest.fixture(scope="module")
def shell():
    with lab_shell("2 --backend gloo --threads 1 --timeout 60") as ip:
        ip.run_cell_magic("lab", "", RANK_CELL)
        ip.user_ns["notebook_only_value"] = 2
        completed(ip, "%%lab\nnotebook_only_v")  # the notebook's own completer (jedi) loads on its first use
        yield ip


def completed(shell, cell: str) -> list[str]:
    """What Tab at the end of ``cell`` offers, as the notebook's kernel answers it."""
    with provisionalcompleter():
        return [found.text for found in shell.Completer.completions(cell, len(cell))]


def timed(shell, cell: str) -> tuple[list[str], float]:
    began = time.monotonic()
    texts = completed(shell, cell)
    return texts, time.monotonic() - began


def test_tab_in_a_lab_cell_offers_a_name_only_the_ranks_have(shell):
    assert "only_on_ranks_value" not in shell.user_ns
    assert "only_on_ranks_value" in completed(shell, "%%lab\nx = 2\nonly_on_r")
    assert "notebook_only_value" in completed(shell, "%%lab\nnotebook_only_v")  # the notebook's own stay
    assert "only_on_ranks_value" not in completed(shell, "only_on_r")  # a notebook cell: the notebook's names


def test_attribute_completion_of_a_rank_only_object_runs_none_of_its_code(shell):
    assert completed(shell, "%%lab\nprint(box.al") == [".alpha", ".alpine"]
    assert ".costly" in completed(shell, "%%lab\nbox.")
    assert completed(shell, "%%lab\nbox.costly.al") == []  # a property is not called to reach what it returns
    lab = shell.user_ns["lab"]
    assert lab.run_cell("Box.reads") == ["0", "0"]
    assert ".all_reduce" in completed(shell, "%%lab\ndist.all_re")
    assert ".zeros_like" in completed(shell, "%%lab\ntorch.zeros_l")


def test_the_cells_ranks_option_picks_the_rank_that_completes(shell):
    assert "lonely_on_one" in completed(shell, "%%lab --ranks 1\nlonely_on_")
    assert "lonely_on_one" not in completed(shell, "%%lab\nlonely_on_")  # rank 0 has no such name
    lab = shell.user_ns["lab"]
    assert [found.text for found in lab.complete("lonely_on_", ranks=[1, 0])] == ["lonely_on_one"]


def test_in_auto_mode_a_plain_cell_completes_from_the_ranks(shell):
    magics = shell.magics_manager.registry["LabMagics"]
    assert "only_on_ranks_value" not in completed(shell, "only_on_r")
    magics.auto = True
    try:
        assert "only_on_ranks_value" in completed(shell, "y = 1\nonly_on_r")
        assert "only_on_ranks_value" not in completed(shell, "%time only_on_r")  # a magic's cell runs here
    finally:
        magics.auto = False


def test_who_lists_each_tensors_shape_per_rank_and_marks_where_ranks_differ(shell):
    table = shell.run_line_magic("lab", "who")
    assert table.differences == {"lonely_on_one": "only on rank 1", "shaped": "shape"}
    lines = str(table).splitlines()
    assert lines[0] == "6 variables on ranks 0, 1; 2 differ across ranks"
    rows = [line.split(None, 1) for line in lines[2:]]
    assert ["same", "all    Tensor  (2, 3) float32 cpu"] in rows
    assert ["shaped", "0      Tensor  (1, 4) float32 cpu  shape"] in rows
    assert ["1", "Tensor  (2, 4) float32 cpu"] in rows  # shaped's other rank, on a row of its own
    assert ["lonely_on_one", "1      int     5                   only on rank 1"] in rows
    assert not {"rank", "torch", "dist", "In", "Out", "exit", "quit", "__labkit__"} & set(table.names)
    with pytest.raises(UsageError, match="did you mean --ranks"):
        shell.run_line_magic("lab", "who --rank 1")
    only_one = shell.run_line_magic("lab", "who --ranks 1")
    assert only_one.differences == {} and sorted(only_one.ranks) == [1]


def test_completion_answers_fast_on_an_idle_lab(shell):
    lab = shell.user_ns["lab"]
    seconds = []
    for _ in range(20):
        began = time.monotonic()
        assert [found.text for found in lab.complete("only_on_r")] == ["only_on_ranks_value"]
        seconds.append(time.monotonic() - began)
    assert statistics.median(seconds) < 0.1, seconds


def test_while_a_run_holds_the_ranks_tab_falls_back_to_the_notebook_at_once(shell):
    lab = shell.user_ns["lab"]
    run = lab.train("ddp", "mlp", steps=100000, log_every=100000, background=True)
    try:
        assert lab.session.busy_with is not None
        began = time.monotonic()
        assert lab.complete("only_on_r") == [] and time.monotonic() - began < 0.05  # no rank is even asked
        # The whole Tab: the notebook's own completer shares two cores with the training ranks here.
        texts, seconds = timed(shell, "%%lab\nnotebook_only_v")
        assert "notebook_only_value" in texts and seconds < 2, seconds
        assert "only_on_ranks_value" not in completed(shell, "%%lab\nonly_on_r")
        with pytest.raises(LabBusy):
            lab.who()
    finally:
        run.stop()
        run.wait(60)
    assert "only_on_ranks_value" in completed(shell, "%%lab\nonly_on_r")


def test_a_frozen_rank_costs_a_tab_at_most_its_wait_and_the_lab_goes_on(shell):
    lab = shell.user_ns["lab"]
    victim = lab.cluster.pid_of[0]
    # Frozen for well under the 2 s after which the controller drops a silent engine (and the lab replaces it).
    os.kill(victim, signal.SIGSTOP)
    try:
        began = time.monotonic()
        assert lab.complete("only_on_r") == [] and time.monotonic() - began < 0.5
        texts, seconds = timed(shell, "%%lab\nnotebook_only_v")
        assert "notebook_only_value" in texts and seconds < 1, seconds
        table = lab.who(timeout=5)
        assert table.missing[0].startswith("was frozen") and "only_on_ranks_value" in table.names
    finally:
        os.kill(victim, signal.SIGCONT)
    assert lab.run_cell("only_on_ranks_value + 1") == ["2", "2"]  # the same processes, namespaces kept
    assert lab.cluster.pid_of[0] == victim
    assert "only_on_ranks_value" in completed(shell, "%%lab\nonly_on_r")
