"""``RankVariables`` from hand-made rank answers: the table, where ranks differ, and the ranks left out. Pure."""

from labkit.views.rank_variables import RankVariables, describe, what_differs

TENSOR = {"type": "Tensor", "shape": [4, 8], "dtype": "float32", "device": "cpu"}


def test_what_a_variable_is_in_words():
    assert describe(TENSOR) == "(4, 8) float32 cpu"
    assert describe({**TENSOR, "placement": "Shard(dim=0) over dp=2"}) == "(4, 8) float32 cpu, Shard(dim=0) over dp=2"
    assert describe({"type": "Linear", "parameters": 1056}) == "1,056 parameters"
    assert describe({"type": "list", "length": 1}) == "1 item"
    assert describe({"type": "int", "value": "3"}) == "3"
    assert describe({"type": "Box"}) == ""


def test_what_differs_names_the_missing_ranks_and_each_field():
    assert what_differs({0: TENSOR, 1: dict(TENSOR)}, [0, 1]) == ""
    assert what_differs({0: TENSOR, 1: {**TENSOR, "shape": [2, 8], "device": "cuda:1"}}, [0, 1]) == "shape, device"
    assert what_differs({1: TENSOR}, [0, 1, 2]) == "only on rank 1"
    assert what_differs({0: TENSOR, 2: {"type": "int", "value": "1"}}, [0, 1, 2]) == \
        "only on ranks 0, 2, type, shape, dtype, device, value"


def test_the_table_has_a_row_per_name_and_one_per_group_of_ranks_where_they_differ():
    variables = RankVariables({
        0: {"model": {"type": "Linear", "parameters": 10}, "x": TENSOR},
        1: {"model": {"type": "Linear", "parameters": 10}, "x": {**TENSOR, "shape": [2, 8]}, "lonely": {
            "type": "str", "value": "'hi'"}},
    })
    assert variables.names == ["lonely", "model", "x"]
    assert variables.differences == {"lonely": "only on rank 1", "x": "shape"}
    assert str(variables).splitlines() == [
        "3 variables on ranks 0, 1; 2 differ across ranks",
        "name    ranks  type    what                differs",
        "lonely  1      str     'hi'                only on rank 1",
        "model   all    Linear  10 parameters",
        "x       0      Tensor  (4, 8) float32 cpu  shape",
        "        1      Tensor  (2, 8) float32 cpu",
    ]
    assert repr(variables) == str(variables)
    page = variables._repr_html_()
    # the differing names' rows are marked, both of x's among them; model's is not
    assert page.count("#fff2cc") == 5 * 3 and "<td style='padding:2px 8px;background:white'>model</td>" in page


def test_ranks_that_did_not_answer_are_named_below_the_table():
    variables = RankVariables({0: {"a": {"type": "int", "value": "1"}}},
                              {1: "did not answer within 10 s", 2: "was frozen (stopped by a signal such as SIGSTOP)"})
    lines = str(variables).splitlines()
    assert lines[0] == "1 variable on rank 0"
    assert lines[-2:] == ["rank 1 is left out: it did not answer within 10 s",
                          "rank 2 is left out: it was frozen (stopped by a signal such as SIGSTOP)"]
    assert str(RankVariables({0: {}, 1: {}})) == "no variables on ranks 0, 1"
    assert str(RankVariables({}, {0: "failed: OSError: gone"})).splitlines()[0] == "no rank answered"
