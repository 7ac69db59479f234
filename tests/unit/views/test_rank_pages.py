"""Ranks' output as HTML: the live view and one page per rank."""

from labkit.views.rank_blocks import group_blocks
from labkit.views.rank_items import Shown, Value
from labkit.views.rank_pages import blocks_html, bundle_html, ranks_view_html


def test_the_richest_form_that_a_page_holds_is_chosen():
    assert bundle_html({"text/plain": "p", "text/html": "<b>h</b>", "image/png": "AAA"}) == "<b>h</b>"
    assert bundle_html({"text/plain": "p", "image/png": "AAA"}).startswith('<img src="data:image/png;base64,AAA"')
    assert bundle_html({"text/plain": "a<b"}) .endswith(">a&lt;b</pre>")


def test_the_live_view_shows_lines_images_and_the_note():
    blocks = group_blocks({0: ["hello", Shown({"text/plain": "fig", "image/png": "QUJD"})], 1: ["hello"]})
    page = blocks_html(blocks, [], "rank 1 waits in all_reduce")
    assert "[ranks 0-1] hello" in page and "data:image/png;base64,QUJD" in page
    assert "labkit: rank 1 waits in all_reduce" in page


def test_tabs_and_grid_hold_every_rank_and_are_stable_for_the_same_output():
    items = {0: ["zero", Value("0", {"text/html": "<i>0</i>"})], 1: ["one"]}
    tabs = ranks_view_html(items, {1: ["warning"]}, "tabs")
    assert tabs == ranks_view_html(items, {1: ["warning"]}, "tabs")  # nothing random: saved notebooks compare
    assert tabs.count('type="radio"') == 2 and "<i>0</i>" in tabs and "warning" in tabs
    grid = ranks_view_html(items, {}, "grid")
    assert grid.startswith("<table") and grid.index("zero") < grid.index("one")
    assert "(no output)" in ranks_view_html({0: [], 1: ["x"]}, {}, "grid")
