"""The magics' argument parsing without ranks: one-line errors with "did you mean", help of one line per option."""

import pytest
from IPython.core.error import UsageError

from labkit.magic_args import CommandParser, asks_for_help, choice_list, unknown_word


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
