"""What a rank reports of an error in user work: the user's frames with their lines, the lab's hidden
(``rank.failures.user_traceback``). No processes: the lab's frames are those of labkit's own files."""

import linecache

from labkit.rank.failures import user_traceback
from labkit.rank.own_model import show_cells
from labkit.torch_support.batches import call_model

CELL = "<ipython-input-7-0123456789ab>"
SOURCE = '''
def forward(x):
    scale = 2
    raise ValueError("boom in forward")
'''


def cell_function():
    namespace: dict = {}
    exec(compile(SOURCE, CELL, "exec"), namespace)
    return namespace["forward"]


def failed(function):
    try:
        call_model(function, (1, 2))  # labkit's frame between this test and the user's function
    except ValueError as error:
        return error
    raise AssertionError("it did not fail")


def test_the_lab_frames_above_the_users_are_hidden_and_counted():
    shown = user_traceback(failed(cell_function()), own_files=())
    lines = shown.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in failed" in lines[1]  # a caller that is no lab file stays
    assert "  (1 lab frame hidden)" in lines
    assert "batches.py" not in shown
    assert f'File "{CELL}", line 4, in forward' in shown
    assert lines[-1] == "ValueError: boom in forward"


def test_a_notebook_cells_lines_show_once_the_rank_keeps_them():
    linecache.cache.pop(CELL, None)
    assert 'raise ValueError("boom in forward")' not in user_traceback(failed(cell_function()), own_files=())
    show_cells({CELL: SOURCE.splitlines(keepends=True)})
    try:
        linecache.checkcache()  # what the traceback module does first: the cell's lines stay
        assert '    raise ValueError("boom in forward")' in user_traceback(failed(cell_function()), own_files=())
    finally:
        linecache.cache.pop(CELL, None)


def test_an_error_the_lab_raises_itself_keeps_its_frames():
    try:
        call_model(lambda: None, object())  # no batch: raised inside the lab, under this test's frame
    except TypeError as error:
        shown = user_traceback(error, own_files=())
    assert "hidden" not in shown and "batches.py" in shown
