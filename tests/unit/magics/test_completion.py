"""Which part of a cell the ranks complete, and how their answer becomes an IPython matcher result; the matcher
comes and goes with the extension. No ranks start."""

from IPython.core.completer import provisionalcompleter

from labkit.magics.completion import MATCHER_ID, RanksCode, matcher_result, ranks_code
from labkit.runs.rank_names import RankCompletion
from tests.conftest import ipython_shell


def cursor_at_end(text: str) -> tuple[str, int, int]:
    lines = text.split("\n")
    return text, len(lines) - 1, len(lines[-1])


def test_a_lab_cell_completes_its_body_with_the_cursor_counted_from_the_body():
    assert ranks_code(*cursor_at_end("%%lab\nx = 1\nmodel.we")) == RanksCode("x = 1\nmodel.we", 14)
    # the cursor in the middle of a line of the body
    assert ranks_code("%%lab\nab = cd\nef", 1, 2) == RanksCode("ab = cd\nef", 2)
    # blank lines before the magic's line, as IPython allows
    assert ranks_code(*cursor_at_end("\n  %%lab\nbox.")) == RanksCode("box.", 4)


def test_the_magic_line_itself_and_other_cells_are_not_the_ranks_code():
    assert ranks_code("%%lab --ranks 1\nx", 0, 9) is None  # completing the options
    assert ranks_code(*cursor_at_end("import os\nos.pa")) is None
    assert ranks_code(*cursor_at_end("%%labby\nx")) is None  # another magic that starts alike
    assert ranks_code(*cursor_at_end("%%time\nx")) is None
    assert ranks_code("", 0, 0) is None


def test_the_ranks_option_picks_the_rank_and_a_half_typed_one_falls_back_to_rank_0():
    assert ranks_code(*cursor_at_end("%%lab --ranks 1,3\nx")).ranks == [1, 3]
    assert ranks_code(*cursor_at_end("%%lab --timeout 5 --ranks=2\nx")).ranks == [2]
    assert ranks_code(*cursor_at_end("%%lab --ranks\nx")).ranks is None
    assert ranks_code(*cursor_at_end("%%lab --site --ranks 1\nx")) == RanksCode("x", 1, [1], None)
    assert ranks_code(*cursor_at_end("%%lab --ranks 1,a\nx")).ranks is None
    assert ranks_code(*cursor_at_end("%%lab --ranks '1\nx")).ranks is None  # unbalanced quote
    assert ranks_code(*cursor_at_end("%%lab --site home\nx")).site == "home"


def test_in_auto_mode_every_cell_but_a_magics_is_the_ranks_code():
    assert ranks_code(*cursor_at_end("x = 1\nmod"), auto=True) == RanksCode("x = 1\nmod", 9)
    assert ranks_code(*cursor_at_end("%lab status\nx"), auto=True) is None
    assert ranks_code(*cursor_at_end("!ls\nx"), auto=True) is None
    assert ranks_code(*cursor_at_end("%%lab --ranks 1\nmod"), auto=True) == RanksCode("mod", 3, [1])
    assert ranks_code(*cursor_at_end("x = 1\nmod"), auto=False) is None


def test_the_ranks_answer_is_one_fragment_ending_at_the_cursor():
    code = "y = box.al"
    result = matcher_result([RankCompletion(7, 10, ".alpha", "attribute"),
                             RankCompletion(7, 10, ".alps", "attribute"),
                             RankCompletion(8, 10, "alright", "dict key")], code, 10)
    assert result["matched_fragment"] == ".al"
    assert [(found.text, found.type) for found in result["completions"]] == [(".alpha", "attribute"),
                                                                              (".alps", "attribute")]
    assert result["suppress"] is False
    assert list(matcher_result([], code, 10)["completions"]) == []


def test_the_matcher_comes_with_the_extension_and_goes_with_it():
    shell = ipython_shell()

    def ours() -> list:
        return [matcher for matcher in shell.Completer.custom_matchers
                if getattr(matcher, "matcher_identifier", None) == MATCHER_ID]

    shell.run_line_magic("load_ext", "labkit")
    try:
        assert len(ours()) == 1
        shell.user_ns["notebook_side_name"] = 1
        # No lab: a %%lab cell completes from the notebook alone, quietly.
        cell = "%%lab\nnotebook_side_n"
        with provisionalcompleter():
            texts = [found.text for found in shell.Completer.completions(cell, len(cell))]
        assert "notebook_side_name" in texts
    finally:
        shell.run_line_magic("unload_ext", "labkit")
        shell.user_ns.pop("notebook_side_name", None)
    assert ours() == []
