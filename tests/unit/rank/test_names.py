"""A rank's names, in this process: which are the user's, how each is described, and what IPython's completer
offers over a namespace without running the objects' code. No ranks start."""

import sys

import numpy
import torch
from torch import nn

from labkit.rank.names import complete, describe_names, describe_value, placement_text, user_variables
from tests.conftest import ipython_shell


def test_the_lab_and_ipython_names_modules_and_underscores_are_not_the_users():
    hidden_out = {}
    namespace = {"__labkit__": object(), "rank": 0, "world_size": 2, "device": "cpu", "mesh": None,
                 "torch": torch, "dist": object(), "exit": sys.exit, "quit": sys.exit, "_private": 1, "_": 3,
                 "np": numpy, "Out": hidden_out, "In": ["rebound by the user"], "weights": torch.ones(2)}
    hidden = {"Out": hidden_out, "In": []}
    # In was rebound by the user: no longer IPython's, so it is listed
    assert sorted(user_variables(namespace, hidden)) == ["In", "weights"]


def test_tensors_modules_containers_and_scalars_are_described_by_what_tells_them_apart():
    assert describe_value(torch.zeros(3, 4, dtype=torch.bfloat16)) == {
        "type": "Tensor", "shape": [3, 4], "dtype": "bfloat16", "device": "cpu"}
    assert describe_value(nn.Parameter(torch.ones(2)))["type"] == "Parameter"
    assert describe_value(nn.Linear(4, 2)) == {"type": "Linear", "parameters": 4 * 2 + 2}
    assert describe_value([1, 2, 3]) == {"type": "list", "length": 3}
    assert describe_value(numpy.zeros((2, 5), dtype=numpy.int16)) == {
        "type": "ndarray", "shape": [2, 5], "dtype": "int16", "device": "cpu"}
    assert describe_value(0.5) == {"type": "float", "value": "0.5"}
    long = describe_value("x" * 1000)["value"]
    assert len(long) == 40 and long.startswith("'xxx") and long.endswith("...")
    assert describe_value(nn.Linear) == {"type": "class"}
    assert describe_value(describe_value) == {"type": "function"}


def test_a_detail_that_raises_leaves_the_type():
    class Broken(list):
        def __len__(self):
            raise RuntimeError("no length")

    assert describe_value(Broken()) == {"type": "Broken"}


def test_described_names_come_sorted():
    assert list(describe_names({"b": 1, "a": 2, "rank": 0}, {})) == ["a", "b"]


def test_a_dtensor_placement_in_words():
    assert placement_text(["Shard(dim=0)"], (2,), ("dp",)) == "Shard(dim=0) over dp=2"
    assert placement_text(["Shard(dim=0)", "Replicate()"], (2, 2), ("dp", "tp")) == \
        "Shard(dim=0), Replicate() over dp=2, tp=2"
    assert placement_text(["Replicate()"], (4,), None) == "Replicate() over mesh (4,)"


class Box:
    reads = 0

    def __init__(self) -> None:
        self.alpha = 1

    @property
    def costly(self):
        Box.reads += 1
        return self


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)


class OwnGetattr(nn.Module):
    reads = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)

    def __getattr__(self, name):
        OwnGetattr.reads += 1
        return super().__getattr__(name)


def texts(namespace: dict, code: str) -> list[str]:
    return [text for _, _, text, _ in complete(ipython_shell(), namespace, code, len(code))]


def test_completion_lists_attributes_without_running_properties_or_custom_getattr():
    namespace = {"box": Box(), "net": Net(), "own": OwnGetattr(), "only_on_ranks_value": 1}
    assert texts(namespace, "only_on_r") == ["only_on_ranks_value"]
    assert ".alpha" in texts(namespace, "box.") and ".costly" in texts(namespace, "box.")
    assert texts(namespace, "box.costly.al") == [] and Box.reads == 0
    # torch's own Module.__getattr__ reaches submodules; a subclass's own __getattr__ is never called
    assert texts(namespace, "net.fc.we") == [".weight"]
    assert texts(namespace, "own.fc.we") == [] and OwnGetattr.reads == 0


def test_completion_leaves_magics_out_and_reports_where_each_completion_starts():
    found = complete(ipython_shell(), {"model": nn.Linear(1, 1)}, "x = model.tra", 13)
    assert {(start, end, text) for start, end, text, _ in found} == {(9, 13, ".train"), (9, 13, ".training")}
    assert all(kind != "magic" for *_, kind in complete(ipython_shell(), {}, "%ti", 3))
