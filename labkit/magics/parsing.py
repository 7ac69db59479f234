"""The one argument parser of the magics: one-line mistakes with a "did you mean", help of one line per option.

A magic is typed in a notebook cell, so a mistake is answered with the one line
that matters (an IPython ``UsageError``, which the notebook shows without a
traceback) and a pointer to ``--help``, never argparse's usage dump; ``--help``
shows the command's options, one line each, and is not an error. Every command's
parser, the cell magic's included, is made by ``command_parser``.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from IPython.core.error import UsageError

from labkit.magics.commands import CELL, CELL_SUMMARY, SUMMARIES

HELP_WORDS = ("-h", "--help")


class HelpShown(Exception):
    """Raised after a parser printed its help: the command does nothing more."""


def asks_for_help(words: Iterable[str]) -> bool:
    return any(word in HELP_WORDS for word in words)


def choice_list(choices: Iterable[object]) -> str:
    """``a, b or c``."""
    names = [str(choice) for choice in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def unknown_word(kind: str, word: str, known: Iterable[object]) -> str:
    """``unknown command 'trian': did you mean 'train'?`` (or without the question when nothing is close)."""
    close = difflib.get_close_matches(word, [str(name) for name in known], n=1)
    return f"unknown {kind} {word!r}" + (f": did you mean {close[0]!r}?" if close else "")


class CommandParser(argparse.ArgumentParser):
    """A magic's parser: mistakes raise a one-line ``UsageError``; ``-h``/``--help`` print the help and raise
    ``HelpShown``. The first line of the help is the usage and the ``description`` (one line)."""

    def __init__(self, prog: str, description: str = "", usage: str | None = None, **kwargs: Any) -> None:
        # No abbreviations: a mistyped --thread is answered "did you mean --threads?", not taken silently.
        super().__init__(prog=prog, description=description, usage=usage, add_help=False, allow_abbrev=False,
                         **kwargs)

    # -- help -----------------------------------------------------------------------

    def format_usage(self) -> str:
        if self.usage:
            return self.usage
        words = [self.prog]
        for action in self._actions:
            if not action.option_strings:
                name = self._metavar(action)
                words.append(f"[{name}]" if action.nargs == "?" else f"{name} ..." if action.nargs in ("*", "+")
                             else name)
        if any(action.option_strings for action in self._actions):
            words.append("[options]")
        return " ".join(words)

    def format_help(self) -> str:
        first = self.format_usage() + (f": {self.description}" if self.description else "")
        rows = [(self._invocation(action), action.help or "") for action in self._actions
                if action.help is not argparse.SUPPRESS]
        width = max((len(name) for name, _ in rows), default=0)
        lines = [first] + [f"  {name.ljust(width)}  {meaning}".rstrip() for name, meaning in rows]
        if self.epilog:  # what the options cannot say (installed plugins that do not load)
            lines.append(self.epilog)
        return "\n".join(lines) + "\n"

    def print_help(self, file: Any = None) -> None:
        print(self.format_help(), end="", file=file)

    def _metavar(self, action: argparse.Action) -> str:
        if isinstance(action.metavar, str) and action.metavar:
            return action.metavar
        if action.choices and not action.option_strings:
            return action.dest.upper()
        if action.type is int:
            return "N"
        if action.type is float:
            return "X"
        return action.dest.upper()

    def _invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return self._metavar(action)
        option = ", ".join(action.option_strings)
        if action.nargs == 0:
            return option
        if action.choices and not action.metavar:
            return f"{option} {'|'.join(map(str, action.choices))}"
        return f"{option} {self._metavar(action)}"

    # -- parsing and mistakes ---------------------------------------------------------

    # argparse declares parse_args as overloads (with a namespace and without); this one signature is both.
    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        words = list(args or [])
        if asks_for_help(words):
            self.print_help()
            raise HelpShown()
        parsed, extra = self.parse_known_args(words, namespace)
        if extra:
            self.error(self._extra_message(extra))
        return parsed

    def _extra_message(self, extra: list[str]) -> str:
        options = [word for word in extra if word.startswith("-") and len(word) > 1]
        if not options:
            return f"unexpected word {extra[0]!r}"
        known = [option for action in self._actions for option in action.option_strings]
        word = options[0].split("=", 1)[0]
        bare = {option.lstrip("-"): option for option in known}  # compared without the dashes all share
        close = difflib.get_close_matches(word.lstrip("-"), list(bare), n=1)
        if close:
            return f"unknown option {word}: did you mean {bare[close[0]]}?"
        return f"unknown option {word}; the options are {', '.join(known)}"

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            noun = (action.option_strings[-1].lstrip("-") if action.option_strings else action.dest).replace("-", " ")
            said = unknown_word(noun, value, action.choices)
            said += " choose " if said.endswith("?") else "; choose "
            raise argparse.ArgumentError(action, said + choice_list(action.choices))

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{_plain(message)} (see {self.prog} --help)")


def command_parser(name: str, **kwargs: Any) -> CommandParser:
    """The parser of ``%lab NAME`` (of the cell magic for ``commands.CELL``), described by its one line."""
    if name == CELL:
        return CommandParser(prog=CELL, description=CELL_SUMMARY, **kwargs)
    return CommandParser(prog=f"%lab {name}", description=SUMMARIES[name], **kwargs)


def _plain(message: str) -> str:
    """argparse's wording made plain: ``argument --steps: invalid int value: 'ten'`` ->
    ``--steps: expected a whole number, got 'ten'``."""
    named = re.match(r"argument ([^:]+): (.*)$", message, re.S)
    if not named:
        return message
    name, said = named.groups()
    name = name.split("/")[-1]  # "-h/--help" style names: the long one
    number = re.match(r"invalid (int|float) value: (.*)$", said)
    if number:
        kind = "a whole number" if number.group(1) == "int" else "a number"
        return f"{name}: expected {kind}, got {number.group(2)}"
    if said == "expected one argument":
        return f"{name} needs a value"
    return f"{name}: {said}" if name.startswith("-") else said  # a word in its place: what it is says enough
