"""Ranks' output as items and blocks: displays in place, updates, clears, what ranks produced alike once."""

from labkit.views.rank_blocks import blocks_text, group_blocks, rank_label
from labkit.views.rank_items import Shown, Value, rank_items


def shown(kind, line, data=None, **mark):
    return {"data": data or {"text/plain": ""}, "metadata": {"labkit": {"kind": kind, "line": line, **mark}}}


HTML = {"text/plain": "<HTML>", "text/html": "<b>x</b>"}


def test_labels_name_ranks_and_spans():
    assert rank_label([3]) == "[rank 3]"
    assert rank_label([0, 1, 2, 3]) == "[ranks 0-3]"
    assert rank_label([5, 0, 2, 6, 7]) == "[ranks 0,2,5-7]"
    assert rank_label([1], "stderr") == "[rank 1:stderr]"


def test_a_display_stands_between_the_lines_it_came_between():
    items = rank_items("a\nb\nc\n", [shown("display", 2, HTML)], Value("42"))
    assert items == ["a", "b", Shown(HTML), "c", Value("42")]


def test_a_display_without_a_mark_stands_after_the_text_so_far():
    assert rank_items("a\n", [{"data": HTML, "metadata": {}}]) == ["a", Shown(HTML)]


def test_an_update_replaces_the_display_it_names_in_place():
    first = {"text/plain": "first"}
    later = {"text/plain": "later"}
    items = rank_items("x\ny\n", [shown("display", 1, first, display_id="d"), shown("update", 2, later, display_id="d")])
    assert items == ["x", Shown(later), "y"]
    # An update of a display that was never shown (or cleared away) shows nothing.
    assert rank_items("", [shown("update", 0, later, display_id="gone")]) == []


def test_clear_removes_what_came_before_and_waits_when_asked():
    assert rank_items("old\nnew\n", [shown("clear", 1)]) == ["new"]
    # wait=True: cleared only when the next output comes; nothing came, so the old output stays.
    assert rank_items("old\n", [shown("clear", 1, wait=True)]) == ["old"]
    assert rank_items("old\n", [shown("clear", 1, wait=True), shown("display", 1, HTML)]) == [Shown(HTML)]


def test_what_every_rank_printed_alike_is_one_block_and_the_rest_stays_per_rank():
    items = {rank: ["loading", f"rank {rank}", "done"] for rank in range(4)}
    assert blocks_text(group_blocks(items)) == ("[ranks 0-3] loading\n[rank 0] rank 0\n[rank 1] rank 1\n"
                                                "[rank 2] rank 2\n[rank 3] rank 3\n[ranks 0-3] done\n")


def test_ranks_that_agree_share_a_block_even_when_others_differ():
    items = {0: ["a", "x"], 1: ["a", "y"], 2: ["a", "x"], 3: ["a", "x"]}
    assert group_blocks(items) == [([0, 1, 2, 3], ["a"]), ([0, 2, 3], ["x"]), ([1], ["y"])]


def test_outputs_of_different_lengths_keep_their_common_start_and_end():
    items = {0: ["start", "one", "end"], 1: ["start", "one", "two", "end"], 2: ["start", "end"]}
    assert group_blocks(items) == [([0, 1, 2], ["start"]), ([0], ["one"]), ([1], ["one", "two"]),
                                   ([0, 1, 2], ["end"])]


def test_a_rank_with_no_output_adds_no_block_and_no_ranks_none():
    assert group_blocks({0: ["a"], 1: []}) == [([0], ["a"])]
    assert group_blocks({}) == [] and blocks_text([]) == ""


def test_a_value_and_a_display_read_as_text():
    assert blocks_text([([0, 1], [Value("'x'"), Shown({"text/plain": "a\nb"})])]) == (
        "[ranks 0-1] Out: 'x'\n[ranks 0-1] a\n[ranks 0-1] b\n")
