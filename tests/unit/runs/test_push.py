"""lab.push's packing and a rank's taking-in, without ranks: what travels how, in which order, what is refused.

Notebook code is made as IPython makes it: a cell's code compiled under a made-up file name in
``__main__``, its lines in linecache. ``labkit.rank.push.receive`` is the rank's side, run here
on a plain dict standing in for a rank's namespace.
"""

import itertools
import json
import linecache
import threading
import types

import pytest

from labkit.magics.parsers import push_parser
from labkit.rank.push import receive
from labkit.runs.push import check_name, class_statement, pack, summary
from labkit.spec.errors import LabConfigError

_cells = itertools.count(100)


def notebook_cell(code: str) -> dict:
    """Run ``code`` as a notebook cell would; its namespace."""
    filename = f"<ipython-input-{next(_cells)}-0123456789ab>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(code, filename, "exec"), namespace)
    return namespace


# Notebook classes as a user writes them (tests/lab/test_push.py pushes them to real ranks).
CLASSES = """
from dataclasses import dataclass

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def norm2(self):
        return self.x ** 2 + self.y ** 2

    def fail(self):
        raise RuntimeError('a method of Point failed')

class Point3(Point):
    def __init__(self, x, y, z):
        super().__init__(x, y)
        self.z = z

    def norm2(self):
        return super().norm2() + self.z ** 2

@dataclass
class Settings:
    lr: float = 0.1
    layers: int = 2
"""

CELL = CLASSES + """
def scaled(x):
    return x * 10 + rank
"""


def rank_namespace(rank=1) -> dict:
    return {"__name__": "__main__", "rank": rank}


def test_each_value_travels_its_way_and_a_rank_builds_them_in_an_order_that_works():
    cell = notebook_cell(CELL)
    values = dict(Point3=cell["Point3"], origin=cell["Point"](3, 4), scaled=cell["scaled"], js=json,
                  Settings=cell["Settings"], dataclass=cell["dataclass"], Point=cell["Point"], data={"a": [1, 2]})
    items, sources, said = pack(values)
    assert said == [("Point3", "by source"), ("origin", "by value"), ("scaled", "by source"), ("js", "module json"),
                    ("Settings", "by source"), ("dataclass", "by value"), ("Point", "by source"),
                    ("data", "by value")]
    # Modules, then values (functions too), then classes (a base before its subclass), then what needs classes.
    assert [item["name"] for item in items] == ["js", "scaled", "dataclass", "data", "Settings", "Point", "Point3",
                                                "origin"]
    assert [item["how"] for item in items] == ["module", "value", "value", "value", "class", "class", "class",
                                               "value"]
    assert len(sources) == 1 and list(sources.values())[0][0] == "\n"  # the cell's lines, for tracebacks
    namespace = rank_namespace(rank=1)
    assert receive(items, namespace) == [item["name"] for item in items]
    assert namespace["scaled"](2) == 21  # its globals are the rank's namespace
    assert namespace["Point3"](1, 2, 2).norm2() == 9 and namespace["Settings"]().lr == 0.1
    assert isinstance(namespace["origin"], namespace["Point"]) and namespace["origin"].norm2() == 25
    assert namespace["Point"] is not cell["Point"]  # built again from its source
    assert namespace["js"] is json and namespace["data"] == {"a": [1, 2]}


def test_a_class_statement_keeps_its_cells_line_numbers_and_decorators():
    cell = notebook_cell(CELL)
    filename, lines, source = class_statement(cell["Point3"])
    line = CELL.splitlines().index("class Point3(Point):")
    assert filename.startswith("<ipython-input-") and source.splitlines()[line] == "class Point3(Point):"
    # A class without methods of its own (a dataclass's are generated) is found in the newest cell defining it.
    assert "@dataclass\nclass Settings:" in class_statement(cell["Settings"])[2]
    # A cell with IPython's own syntax is read as IPython runs it.
    magic = notebook_cell("x = 1\nclass Later:\n    def f(self):\n        return 2\n")
    filename = [name for name in linecache.cache if name.startswith("<ipython-input-")][-1]
    lines = ["%time x = 1\n"] + linecache.cache[filename][2][1:]
    linecache.cache[filename] = (0, None, lines, filename)
    assert class_statement(magic["Later"])[2] == "\nclass Later:\n    def f(self):\n        return 2\n"


def test_what_cannot_travel_is_all_named_and_nothing_is_packed():
    made_up = types.ModuleType("made_up_module")
    hidden = type("Hidden", (), {"__module__": "__main__"})  # no class statement anywhere
    with pytest.raises(LabConfigError) as refused:
        pack({"good_value": 1, "lock": threading.Lock(), "rank": 3, "mod": made_up, "Hidden": hidden, "2x": 1,
              "torch": json})
    said = str(refused.value)
    assert said.startswith("nothing was pushed: ")
    for part in ("lock cannot travel to the ranks (cannot pickle '_thread.lock' object)", "make locks",
                 "rank is the lab's own name", "mod is a module that was not imported by a name",
                 "the class statement of Hidden was not found", "'2x' is not a Python name",
                 "torch is the lab's own name"):
        assert part in said, part
    assert "good_value" not in said
    with pytest.raises(LabConfigError, match="nothing to push"):
        pack({})
    with pytest.raises(LabConfigError, match="holds the module 'made_up_module'"):
        pack({"inside": {"module": made_up}})


def test_the_lab_names_may_take_only_their_own_module():
    assert check_name("dist", json) is not None and check_name("dist", types.ModuleType("torch.distributed")) is None
    assert check_name("mesh", None) is not None and check_name("helper", None) is None


def test_an_instance_of_a_class_the_rank_lacks_is_refused_there_and_the_namespace_is_left_as_it_was():
    cell = notebook_cell(CELL)
    items, _, _ = pack({"first": 1, "origin": cell["Point"](1, 1)})
    namespace = rank_namespace()
    with pytest.raises(NameError, match=r"origin holds an instance of Point.*lab.push\(Point=Point, origin=origin\)"):
        receive(items, namespace)
    assert "first" not in namespace
    needs = notebook_cell("def registered(cls):\n    return cls\n\n@registered\nclass Needs:\n    def f(self):\n        return 1\n")
    items, _, _ = pack({"first": 1, "Needs": needs["Needs"]})
    with pytest.raises(NameError, match=r"the class statement of Needs needs registered.*lab.push\(registered="):
        receive(items, namespace)
    assert "first" not in namespace


def test_a_notebook_function_inside_a_value_travels_by_source():
    cell = notebook_cell("def double(x):\n    return 2 * x + rank\n")
    items, _, said = pack({"table": {"f": cell["double"], "np": json}})
    assert said == [("table", "by value")]
    namespace = rank_namespace(rank=1)
    receive(items, namespace)
    assert namespace["table"]["f"](3) == 7 and namespace["table"]["np"] is json


def test_the_summary_says_where_and_how():
    said = [("helper", "by source"), ("np", "module numpy"), ("data", "by value")]
    assert summary(said, [0, 1], 2) == "pushed to every rank: helper (by source), np (module numpy), data (by value)"
    assert summary(said[:1], [1], 2) == "pushed to rank 1: helper (by source)"


def test_the_push_magic_reads_names_and_ranks():
    options = push_parser().parse_args(["helper", "np", "--ranks", "0,1"])
    assert options.names == ["helper", "np"] and options.ranks == [0, 1]
    assert push_parser().format_help().splitlines()[0].startswith("%lab push NAME ... [options]: put the notebook's")


def test_dunder_names_and_values_over_a_builtin_are_refused_saying_why():
    # lab.push({"__builtins__": {}}) or lab.push(print=None) would break every later call on the ranks.
    with pytest.raises(LabConfigError) as refused:
        pack({"__builtins__": {}, "__name__": "x", "print": None, "len": 3, "fine": 1})
    said = str(refused.value)
    assert "__builtins__ is one of Python's own names (a dunder name)" in said and "__name__ is one of" in said
    assert "print is Python's builtin print(): a NoneType in its place would break every later use" in said
    assert "len is Python's builtin len(): a int" in said and "e.g. lab.push(my_len=...)" in said
    assert "fine" not in said
    assert check_name("print", lambda *args: None) is None  # a function in a builtin's place: a deliberate one
    assert check_name("input", 3, shadows_builtins=True) is None  # a name a notebook function reads, as it reads it
