"""The magics' argument parsing without ranks: one-line errors with "did you mean", help of one line per option,
one parser per command, each described by its summary."""

import pytest
from IPython.core.error import UsageError

from labkit.magics.commands import CELL, CELL_SUMMARY, SUMMARIES
from labkit.magics.help import described_parsers, overview
from labkit.magics.network import join_parser
from labkit.magics.parsers import bench_parser, cell_parser, push_parser, start_parser, who_parser
from labkit.magics.parsing import CommandParser, asks_for_help, choice_list, command_parser, unknown_word
from labkit.magics.queue import ensemble_parser, tasks_parser
from labkit.magics.train_args import train_parser


def small_parser() -> CommandParser:
    parser = CommandParser(prog="%lab train", description="train a zoo model under a strategy")
    parser.add_argument("--model", choices=("mlp", "gpt"), help="the zoo model")
    parser.add_argument("--steps", type=int, help="training steps")
    parser.add_argument("--lr", type=float, help="learning rate")
    parser.add_argument("--verify", action="store_true", help="compare with single-process training")
    return parser


def refusal(parser, words) -> str:
    with pytest.raises(UsageError) as refused:
        parser.parse_args(words)
    return str(refused.value)


def test_a_bad_choice_is_one_line_naming_the_choices():
    assert refusal(small_parser(), ["--model", "resnet"]) == (
        "--model: unknown model 'resnet'; choose mlp or gpt (see %lab train --help)")
    assert refusal(small_parser(), ["--model", "gtp"]) == (
        "--model: unknown model 'gtp': did you mean 'gpt'? choose mlp or gpt (see %lab train --help)")


def test_an_unknown_option_gets_did_you_mean():
    assert refusal(small_parser(), ["--stpes", "5"]) == (
        "unknown option --stpes: did you mean --steps? (see %lab train --help)")
    assert refusal(small_parser(), ["--colour"]) == (
        "unknown option --colour; the options are --model, --steps, --lr, --verify (see %lab train --help)")
    assert refusal(small_parser(), ["soon"]) == "unexpected word 'soon' (see %lab train --help)"


def test_bad_numbers_and_missing_values_say_what_is_expected():
    assert refusal(small_parser(), ["--steps", "ten"]) == (
        "--steps: expected a whole number, got 'ten' (see %lab train --help)")
    assert refusal(small_parser(), ["--lr", "fast"]) == "--lr: expected a number, got 'fast' (see %lab train --help)"
    assert refusal(small_parser(), ["--steps"]) == "--steps needs a value (see %lab train --help)"


def test_help_is_the_usage_then_one_line_per_option():
    assert small_parser().format_help().splitlines() == [
        "%lab train [options]: train a zoo model under a strategy",
        "  --model mlp|gpt  the zoo model",
        "  --steps N        training steps",
        "  --lr X           learning rate",
        "  --verify         compare with single-process training",
    ]


def test_help_words_and_suggestions():
    assert asks_for_help(["--steps", "5", "--help"]) and asks_for_help(["-h"]) and not asks_for_help(["--steps"])
    assert choice_list(["a"]) == "a" and choice_list(["a", "b"]) == "a or b" and choice_list("abc") == "a, b or c"
    assert unknown_word("command", "trian", ["start", "train", "status"]) == (
        "unknown command 'trian': did you mean 'train'?")
    assert unknown_word("command", "launch", ["start", "train"]) == "unknown command 'launch'"


def every_parser() -> dict[str, CommandParser]:
    """Each command's parser as the magics build it, the ones read by hand included."""
    return {"start": start_parser(), "train": train_parser(), "bench": bench_parser(), "push": push_parser(),
            "tasks": tasks_parser(), "ensemble": ensemble_parser(), CELL: cell_parser(), "join-command": join_parser(),
            "who": who_parser(), **described_parsers()}


def test_every_command_has_one_parser_made_one_way_and_described_by_its_summary():
    parsers = every_parser()
    assert sorted(parsers) == sorted([*SUMMARIES, CELL])
    for name, parser in parsers.items():
        assert type(parser) is CommandParser, name
        first = parser.format_help().splitlines()[0]
        assert first.startswith(CELL if name == CELL else f"%lab {name}"), first
        assert first.endswith(": " + (CELL_SUMMARY if name == CELL else SUMMARIES[name])), first
    assert parsers["heal"].format_help() == f"%lab heal: {SUMMARIES['heal']}\n"
    assert command_parser("kill").prog == "%lab kill" and command_parser(CELL).prog == "%%lab"


def test_lab_help_lists_every_command_in_order_then_the_cell_magic():
    lines = overview().splitlines()
    assert lines[0].startswith("%lab COMMAND [options]")
    assert [line.split()[0] for line in lines[1:-1]] == list(SUMMARIES)
    assert lines[-1] == f"%%lab [options]: {CELL_SUMMARY}"


def test_run_and_cell_take_the_watching_switches_before_the_script():
    from labkit.magics.values import split_run_words

    options, script = split_run_words(["--dashboard", "--ranks", "0,2", "--background", "train.py", "--dashboard"])
    assert options["--dashboard"] == "on" and options["--background"] == "on" and options["--instruments"] is None
    assert options["--ranks"] == "0,2"
    assert script == ["train.py", "--dashboard"]  # after the script, its own arguments
    cell = cell_parser().parse_args(["--instruments", "--ranks", "1"])
    assert cell.instruments and not cell.dashboard and not cell.background and cell.ranks == [1]


def test_join_command_reads_its_https_options_and_the_cell_magic_a_site():
    options = join_parser().parse_args(["--https", "--port", "0", "--address", "127.0.0.1", "--ranks", "2",
                                        "--expires", "30m"])
    assert (options.https, options.port, options.address, options.ranks, options.expires) == \
        (True, 0, "127.0.0.1", 2, "30m")
    plain = join_parser().parse_args([])
    assert plain.https is False and plain.expires == "1h" and plain.port is None
    assert cell_parser().parse_args(["--site", "home", "--ranks", "0"]).site == "home"


def test_an_https_option_without_https_is_refused_saying_to_add_it():
    from IPython.core.error import UsageError

    from labkit.magics.network import join_command_line

    with pytest.raises(UsageError, match="--port is for a site that joins over HTTPS: add --https"):
        join_command_line(None, join_parser().parse_args(["--port", "9000"]))  # refused before the lab is asked


def test_train_takes_what_a_nonfinite_loss_does_and_only_its_actions():
    assert vars(train_parser().parse_args(["--on-nonfinite", "skip"])) == {"on_nonfinite": "skip"}
    assert "on_nonfinite" not in vars(train_parser().parse_args([]))  # Lab.train's default applies
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="unknown on nonfinite 'ignore'; choose stop, skip or continue"):
        train_parser().parse_args(["--on-nonfinite", "ignore"])
