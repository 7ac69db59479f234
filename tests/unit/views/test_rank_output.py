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


def test_a_line_printed_in_pieces_shows_as_one_line(capsys):
    output = LiveOutput(RankTexts([0, 1]), live=False)
    output.update(0, "abc", "")
    output.update(1, "one\ntw", "")
    assert capsys.readouterr().out == "[rank 1] one\n"  # the pieces wait for their newline
    output.update(0, "abcdef\n", "")
    output.update(1, "one\ntwo\n", "")
    output.update(0, "abcdef\nx", "warn")  # unfinished at the end of the work: shown then
    output.finish()
    said = capsys.readouterr()
    assert said.out == "[rank 0] abcdef\n[rank 1] two\n[rank 0] x\n"
    assert said.err == "[rank 0:stderr] warn\n"


def test_a_piece_waits_no_longer_than_its_bound(capsys, monkeypatch):
    from labkit.views import line_pieces

    now = [0.0]
    output = LiveOutput(RankTexts([0]), live=False)
    output._pieces = line_pieces.LinePieces(clock=lambda: now[0])
    output.update(0, "loading... ", "")
    output.tick()
    assert capsys.readouterr().out == ""
    now[0] = line_pieces.PIECE_SECONDS
    output.tick()  # a line left open for long still shows while the rank works
    assert capsys.readouterr().out == "[rank 0] loading... \n"
    output.update(0, "loading... done\n", "")
    output.finish()
    assert capsys.readouterr().out == "[rank 0] done\n"
    monkeypatch.setattr(line_pieces, "PIECE_CHARS", 4)
    assert line_pieces.LinePieces().lines("s", "abcdefgh") == ["abcdefgh"]  # too long to wait


def test_carriage_returns_end_lines_and_a_split_crlf_is_one_end():
    from labkit.views.line_pieces import LinePieces

    pieces = LinePieces()
    assert pieces.lines("s", "\r 10%") == [""]
    assert pieces.lines("s", "\r 20%") == [" 10%"]
    assert pieces.lines("s", "\r\n") == [" 20%"]
    assert pieces.lines("s", "a\r") == ["a"]
    assert pieces.lines("s", "\nb\n") == ["b"]
    assert pieces.rest() == []


def test_a_waiting_piece_is_shown_before_a_display_printed_after_it(capsys):
    output = LiveOutput(RankTexts([0]), live=False)
    output.update(0, "before ", "", [{"data": {"text/plain": "<Figure>"}, "metadata": {}}])
    output.update(0, "before after\n", "")
    output.finish()
    assert capsys.readouterr().out == "[rank 0] before \n[rank 0] <Figure>\n[rank 0] after\n"
