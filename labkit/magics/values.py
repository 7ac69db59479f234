"""The words of the ``%lab`` commands turned into values: time limits, rank lists, settings, sizes, durations.

Each is an argparse ``type`` (a mistake raises ``ArgumentTypeError``, which the
command's parser words as one line) or, for the commands whose few words are
read by hand, raises the ``UsageError`` the notebook shows.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from IPython.core.error import UsageError

from labkit.spec.errors import LabConfigError
from labkit.units import parse_duration, positive_seconds, power_of_two_range

RUN_OPTIONS = ("--ranks", "--timeout")  # %lab run's own options, which stand before the script
RUN_FLAGS = ("--instruments", "--dashboard", "--background")  # and its switches, there too
_DECIMAL = re.compile(r"^-?(\d+\.\d*|\.\d+|\d+(\.\d*)?e[-+]?\d+)$", re.IGNORECASE)  # 0.5, .5, 1e-3 (not inf)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a time limit is a number of seconds, e.g. 60; got {text!r}") from None
    try:
        return positive_seconds("a time limit", value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def bounded_count(check: Callable[[int], object]) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number ``check`` bounds (``check(value)`` raises LabConfigError)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        try:
            check(value)
        except LabConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value
    return count


def rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks are written 0,2,3; got {text!r}") from None


def name_values(text: str) -> dict[str, int | float | str]:
    """``dim=128,layers=8`` -> {"dim": 128, "layers": 8} (integers where they are integers, numbers where they
    are written as decimals, else words: the model's settings check the kind each takes)."""
    settings: dict[str, int | float | str] = {}
    for word in text.replace(" ", ",").split(","):
        if not word:
            continue
        name, equals, value = word.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"write settings as name=value, got {word!r}")
        if not name:
            raise argparse.ArgumentTypeError(f"write settings as name=value, e.g. dim=128; got {word!r}")
        settings[name] = int(value) if value.lstrip("-").isdigit() else float(value) if _DECIMAL.match(value) \
            else value
    return settings


def size_range(text: str) -> list[int]:
    """``1KB:16MB`` -> every power of two from 1 KiB to 16 MiB (see ``labkit.units``)."""
    try:
        return power_of_two_range(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def duration(text: str) -> float | None:
    """``30ms`` -> 0.03, ``0.5s`` or ``0.5`` -> 0.5, ``off`` -> None."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise UsageError(str(error)) from None


def split_run_words(words: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """``%lab run``'s words -> ({option: value, switch: "on" or None}, [script, its arguments ...]): options
    stand before the script."""
    options: dict[str, str | None] = dict.fromkeys(RUN_OPTIONS + RUN_FLAGS)
    while words and words[0] in options:
        if words[0] in RUN_FLAGS:  # a switch: present or not
            options[words[0]], words = "on", words[1:]
            continue
        if len(words) < 2:
            raise UsageError(f"{words[0]} needs a value, e.g. %lab run --ranks 0,2 train.py")
        options[words[0]], words = words[1], words[2:]
    return options, words


def run_own_words(words: list[str]) -> list[str]:
    """The words of ``%lab run`` that are its own: its options and the word in the script's place."""
    _, script = split_run_words(words)
    return words[: len(words) - len(script) + 1]
