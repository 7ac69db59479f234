"""Rank output: labelled, in rank order, new text found by difference."""

from labkit.views.rank_output import LiveOutput, RankTexts, label_lines


def test_labels_every_line():
    assert label_lines(2, "a\nb\n") == ["[rank 2] a", "[rank 2] b"]
    assert label_lines(0, "oops", "stderr") == ["[rank 0:stderr] oops"]


def test_render_is_in_rank_order_whatever_the_arrival_order():
    texts = RankTexts([0, 1, 2])
    texts.update(2, "two\n", "")
    texts.update(0, "zero\n", "warn\n")
    texts.update(1, "one\n", "")
    texts.set_result(1, "42")
    out, err = texts.render()
    assert out == "[rank 0] zero\n[rank 1] one\n[rank 1] Out: 42\n[rank 2] two\n"
    assert err == "[rank 0:stderr] warn\n"


def test_update_returns_only_new_text():
    texts = RankTexts([0])
    assert texts.update(0, "a\n", "") == ("a\n", "")
    assert texts.update(0, "a\nb\n", "e") == ("b\n", "e")


def test_values_are_shown_only_when_asked(capsys):
    output = LiveOutput(RankTexts([0]), live=False, show_values=False)
    output.texts.set_result(0, "1")
    output.finish()
    assert capsys.readouterr().out == ""


def test_outside_a_kernel_lines_print_as_they_come(capsys):
    output = LiveOutput(RankTexts([0, 1]), live=False)
    output.update(1, "late\n", "")
    output.update(0, "early\n", "")
    output.texts.set_result(0, "'x'")
    output.finish()
    assert capsys.readouterr().out == "[rank 1] late\n[rank 0] early\n[rank 0] Out: 'x'\n"
