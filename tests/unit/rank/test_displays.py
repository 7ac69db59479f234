"""The rank's display hook: every kind of display sent as display_data, marked and bounded."""

import io
import sys

from IPython.core.formatters import DisplayFormatter
from IPython.display import HTML

from labkit.rank import displays
from labkit.rank.displays import RankDisplays


class Shell:
    def __init__(self):
        self.display_formatter = DisplayFormatter()


def message(kind, content):
    return {"header": {"msg_type": kind}, "msg_type": kind, "content": content}


class Stdout(io.StringIO):
    """A stream that takes attributes, as the engine's does (its write is wrapped to count lines)."""


def made(monkeypatch):
    monkeypatch.setattr(sys, "stdout", Stdout())
    return RankDisplays(Shell())


def test_updates_and_clears_travel_as_marked_display_data(monkeypatch):
    hook = made(monkeypatch)
    hook.begin()
    hook.lines += 3  # three lines printed by the work
    sent = hook._mark(message("update_display_data", {"data": {"text/plain": "x"}, "metadata": {"a": 1},
                                                      "transient": {"display_id": "d1"}}))
    assert sent["msg_type"] == sent["header"]["msg_type"] == "display_data"
    assert sent["content"]["metadata"] == {"a": 1, "labkit": {"kind": "update", "line": 3, "display_id": "d1",
                                                             "bytes": 1}}
    cleared = hook._mark(message("clear_output", {"wait": True}))
    assert cleared["content"]["metadata"]["labkit"] == {"kind": "clear", "line": 3, "wait": True}
    other = message("stream", {"text": "x"})
    assert hook._mark(other) is other


def test_lines_are_counted_from_the_start_of_each_piece_of_work(monkeypatch):
    hook = made(monkeypatch)
    print("one\ntwo")
    hook.begin()
    print("three")
    assert hook._mark(message("display_data", {"data": {"text/plain": ""}}))["content"]["metadata"]["labkit"]["line"] == 1


def test_an_output_too_large_is_replaced_by_a_note_saying_why(monkeypatch):
    monkeypatch.setattr(displays, "MAX_OUTPUT_BYTES", 1000)
    monkeypatch.setattr(displays, "MAX_WORK_BYTES", 1500)
    hook = made(monkeypatch)
    hook.begin()
    big = hook._mark(message("display_data", {"data": {"text/plain": "<Image>", "image/png": "A" * 5000}}))
    data = big["content"]["data"]
    assert list(data) == ["text/plain"] and "<Image> (image/png, 5.0 kB) was not shown: over the" in data["text/plain"]
    assert big["content"]["metadata"]["labkit"]["left_out"] is True
    # Within the one-output bound but past what the work may display in all.
    hook._mark(message("display_data", {"data": {"image/png": "A" * 900}}))
    late = hook._mark(message("display_data", {"data": {"image/png": "A" * 900}}))
    assert "past the" in late["content"]["data"]["text/plain"]


def test_a_value_keeps_its_richest_forms_and_plain_values_cost_nothing(monkeypatch):
    hook = made(monkeypatch)
    assert hook.rich(HTML("<b>x</b>")) == {"text/html": "<b>x</b>"}
    assert hook.rich(42) is None and hook.rich([1, 2]) is None and hook.rich(object()) is None


def test_past_the_count_on_show_one_note_then_nothing_and_a_clear_starts_again(monkeypatch):
    monkeypatch.setattr(displays, "MAX_WORK_OUTPUTS", 2)
    hook = made(monkeypatch)
    hook.begin()
    sent = [hook._mark(message("display_data", {"data": {"text/plain": str(n)}})) for n in range(5)]
    assert [m["content"]["data"]["text/plain"] for m in sent[:2]] == ["0", "1"]
    assert "more than 2 displays on show" in sent[2]["content"]["data"]["text/plain"]
    assert sent[3:] == [None, None]  # not sent at all
    hook._mark(message("clear_output", {"wait": True}))  # a loop that redraws after each clear goes on
    again = hook._mark(message("display_data", {"data": {"text/plain": "frame"}}))
    assert again["content"]["data"] == {"text/plain": "frame"}


def test_a_message_marked_already_is_left_as_it_is(monkeypatch):
    hook = made(monkeypatch)
    marked = message("display_data", {"data": {}, "metadata": {"labkit": {"kind": "update", "line": 0}}})
    assert hook._mark(marked)["content"]["metadata"]["labkit"]["kind"] == "update"


def test_one_hook_per_shell(monkeypatch):
    monkeypatch.setattr(sys, "stdout", Stdout())
    shell = Shell()
    assert RankDisplays.for_shell(shell) is RankDisplays.for_shell(shell)


def test_a_rank_draws_inline_even_where_the_environment_chose_agg():
    import subprocess

    probe = ("import matplotlib\nassert 'agg' in matplotlib.get_backend().lower()\n"
             "from labkit.rank.displays import use_inline_backend\nuse_inline_backend()\n"
             "import matplotlib.pyplot as plt\nprint(matplotlib.get_backend())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module://matplotlib_inline.backend_inline"
