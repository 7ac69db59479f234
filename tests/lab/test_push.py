"""lab.push, %lab push and lab.run on some ranks, on one real 2-rank lab started through IPython's shell.

What the notebook defines is defined in the shell's cells (``define``), so it is notebook code as
in Jupyter: module ``__main__``, its lines kept only in linecache.
"""

import threading
import types

import numpy
import pytest
from IPython.core.error import UsageError

from labkit import LabConfigError, RankFailure

from tests.conftest import lab_shell
from tests.unit.runs.test_push import CLASSES

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def shell():
    with lab_shell("2 --backend gloo --threads 1 --timeout 30") as ip:
        yield ip


@pytest.fixture
def lab(shell):
    return shell.user_ns["lab"]


def define(shell, code: str) -> dict:
    """Run ``code`` as a notebook cell; the notebook's namespace."""
    shell.run_cell(code).raise_error()
    return shell.user_ns


def on_ranks(lab, expression: str) -> list:
    return lab.run_cell(expression)


def test_a_pushed_notebook_function_works_in_a_cell_and_its_traceback_shows_its_lines(shell, lab, capsys):
    notebook = define(shell, "def scaled(x):\n    return x * 10 + rank\n\n"
                             "def broken():\n    raise ValueError('inside broken')\n")
    with pytest.raises(RankFailure, match="NameError"):
        on_ranks(lab, "scaled(2)")  # not on the ranks until pushed
    lab.push(scaled=notebook["scaled"], broken=notebook["broken"])
    assert capsys.readouterr().out.endswith("pushed to every rank: scaled (by source), broken (by source)\n")
    assert on_ranks(lab, "scaled(2)") == ["20", "21"]  # its globals are the rank's namespace
    shell.run_cell_magic("lab", "", "scaled(1)")
    assert "[rank 1] Out: 11" in capsys.readouterr().out
    with pytest.raises(RankFailure) as caught:
        on_ranks(lab, "broken()")
    assert "raise ValueError('inside broken')" in caught.value.details()


def test_a_pushed_class_is_built_on_the_ranks_with_its_instances(shell, lab, capsys):
    notebook = define(shell, CLASSES)

    # A subclass before its base, an instance before its class: the ranks build them in an order that works.
    lab.push(Point3=notebook["Point3"], origin=notebook["Point"](3, 4), Point=notebook["Point"],
             dataclass=notebook["dataclass"], Settings=notebook["Settings"])
    assert "Point3 (by source), origin (by value), Point (by source)" in capsys.readouterr().out
    assert on_ranks(lab, "Point3(1, 2, rank).norm2(), origin.norm2(), isinstance(origin, Point), Settings().layers") \
        == ["(5, 25, True, 2)", "(6, 25, True, 2)"]
    with pytest.raises(RankFailure) as caught:
        on_ranks(lab, "origin.fail()")
    assert "raise RuntimeError('a method of Point failed')" in caught.value.details()


def test_a_module_is_imported_on_each_rank_by_name(shell, lab, capsys):
    notebook = define(shell, "import numpy as np_alias\nimport os.path as osp")
    lab.push(np_alias=notebook["np_alias"], osp=notebook["osp"], libs={"np": numpy})
    assert "np_alias (module numpy), osp (module posixpath), libs (by value)" in capsys.readouterr().out
    assert on_ranks(lab, "int(np_alias.arange(3).sum()) + rank, osp.join('a', 'b'), libs['np'] is np_alias") == \
        ["(3, 'a/b', True)", "(4, 'a/b', True)"]


def test_data_travels_pickled_to_all_or_some_ranks(lab, capsys):
    import torch

    lab.push({"ranks": [9]}, config={"lr": 0.1, "sizes": [4, 8]}, weights=torch.arange(4.0))
    assert on_ranks(lab, "config['sizes'][1] * 2, float(weights.sum()), ranks") == ["(16, 6.0, [9])"] * 2
    capsys.readouterr()
    lab.push(only_on_one=1, ranks=[1])
    assert capsys.readouterr().out.endswith("pushed to rank 1: only_on_one (by value)\n")
    assert on_ranks(lab, "'only_on_one' in globals()") == ["False", "True"]


def test_what_cannot_travel_is_refused_before_any_rank_is_asked(lab, monkeypatch):
    sent = []
    monkeypatch.setattr(lab.session, "execute", lambda *args, **kwargs: sent.append(args))
    with pytest.raises(LabConfigError) as refused:
        lab.push(good_value=1, lock=threading.Lock(), made_up=types.ModuleType("made_up_module"))
    said = str(refused.value)
    assert said.startswith("nothing was pushed: lock cannot travel to the ranks (cannot pickle '_thread.lock'")
    assert "made_up is a module that was not imported" in said and "good_value" not in said
    assert sent == []
    monkeypatch.undo()
    assert on_ranks(lab, "'good_value' in globals()") == ["False", "False"]


def test_a_push_that_fails_on_the_ranks_leaves_their_namespaces_as_they_were(shell, lab):
    notebook = define(shell, "def registered(cls):\n    return cls\n\n"
                             "@registered\nclass Registered:\n    def f(self):\n        return 1\n")
    with pytest.raises(RankFailure, match="the class statement of Registered needs registered") as caught:
        lab.push(before_it=1, Registered=notebook["Registered"])
    assert "lab.push(registered=registered, Registered=Registered)" in caught.value.details()
    assert on_ranks(lab, "'before_it' in globals()") == ["False", "False"]


def test_the_push_magic_takes_notebook_names(shell, lab, capsys):
    define(shell, "def cube(x):\n    return x ** 3\n\nfactor = 3\nimport json")
    shell.run_line_magic("lab", "push cube factor json")
    assert capsys.readouterr().out.endswith(
        "pushed to every rank: cube (by source), factor (by value), json (module json)\n")
    shell.run_cell_magic("lab", "", "cube(factor) + rank, json.dumps(rank)")
    out = capsys.readouterr().out
    assert "[rank 0] Out: (27, '0')" in out and "[rank 1] Out: (28, '1')" in out
    shell.run_line_magic("lab", "push factor --ranks 1")
    assert capsys.readouterr().out.endswith("pushed to rank 1: factor (by value)\n")
    with pytest.raises(UsageError) as refused:
        shell.run_line_magic("lab", "push cube cuube no_such_name")
    assert str(refused.value) == ("%lab push takes names defined in the notebook; not defined: cuube (did you mean "
                                  "cube?), no_such_name")
    with pytest.raises(UsageError, match="the following arguments are required: NAME"):
        shell.run_line_magic("lab", "push")


def test_run_on_some_ranks_returns_their_results_in_rank_order(shell, lab):
    notebook = define(shell, "def where(offset, scale=1):\n    return (rank + offset) * scale\n")
    where = notebook["where"]
    assert lab.run(where, 10, ranks=[1]) == [11]
    assert lab.run(where, 10, ranks=0, scale=2) == [20]
    assert lab.run(where, 10, ranks=[1, 0]) == [10, 11]
    assert lab.run(where, 10) == [10, 11]
    with pytest.raises(LabConfigError, match="between 0 and 1"):
        lab.run(where, 10, ranks=[2])
