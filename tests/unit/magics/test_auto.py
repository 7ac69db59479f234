"""%lab auto: which cells go to the ranks, and how IPython is told (no ranks start)."""

from labkit.magics.auto import AutoMode, on_the_ranks
from tests.conftest import ipython_shell


def test_plain_cells_go_to_the_ranks_magics_shell_commands_and_blank_cells_stay():
    assert on_the_ranks(["x = 1\n"]) and on_the_ranks(["\n", "# a comment\n", "y = 2\n"])
    assert not on_the_ranks(["%lab auto off\n"]) and not on_the_ranks(["%%time\n", "x = 1\n"])
    assert not on_the_ranks(["!ls\n"]) and not on_the_ranks(["\n", "   \n"]) and not on_the_ranks([])


def test_a_cell_in_auto_mode_becomes_a_lab_cell_and_the_mode_leaves_no_trace_when_off():
    shell = ipython_shell()  # IPython's test shell: one per test session, as every magics test uses
    auto = AutoMode(shell)
    before = list(shell.input_transformers_cleanup)
    auto.set(True)
    auto.set(True)  # twice on: one rewrite, not two
    assert shell.transform_cell("x = rank\n") == "get_ipython().run_cell_magic('lab', '--auto', 'x = rank\\n')\n"
    assert shell.transform_cell("%lab status\n") == "get_ipython().run_line_magic('lab', 'status')\n"
    auto.set(False)
    assert shell.input_transformers_cleanup == before and not auto.on
    assert shell.transform_cell("x = rank\n") == "x = rank\n"
