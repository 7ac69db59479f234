"""argparse for the magics: one-line mistakes with a "did you mean", help of one line per option.

A magic is typed in a notebook cell, so a mistake is answered with the one line
that matters (an IPython ``UsageError``, which the notebook shows without a
traceback) and a pointer to ``--help``, never argparse's usage dump; ``--help``
shows the command's options, one line each, and is not an error.
"""

from __future__ import annotations

import argparse
import difflib
import re

from IPython.core.error import UsageError

HELP_WORDS = ("-h", "--help")


class HelpShown(Exception):
    """Raised after a parser printed its help: the command does nothing more."""


def asks_for_help(words) -> bool:
    return any(word in HELP_WORDS for word in words)


def choice_list(choices) -> str:
    """``a, b or c``."""
    choices = [str(choice) for choice in choices]
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def unknown_word(kind: str, word: str, known) -> str:
    """``unknown command 'trian': did you mean 'train'?`` (or without the question when nothing is close)."""
    close = difflib.get_close_matches(word, [str(name) for name in known], n=1)
    return f"unknown {kind} {word!r}" + (f": did you mean {close[0]!r}?" if close else "")


class CommandParser(argparse.ArgumentParser):
    """A magic's parser: mistakes raise a one-line ``UsageError``; ``-h``/``--help`` print the help and raise
    ``HelpShown``. The first line of the help is the usage and the ``description`` (one line)."""

    def __init__(self, prog: str, description: str = "", usage: str | None = None, **kwargs) -> None:
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
        return "\n".join(lines) + "\n"

    def print_help(self, file=None) -> None:
        print(self.format_help(), end="", file=file)

    def _metavar(self, action) -> str:
        if action.metavar:
            return action.metavar
        if action.choices and not action.option_strings:
            return action.dest.upper()
        return {int: "N", float: "X"}.get(action.type, action.dest.upper())

    def _invocation(self, action) -> str:
        if not action.option_strings:
            return self._metavar(action)
        option = ", ".join(action.option_strings)
        if action.nargs == 0:
            return option
        if action.choices and not action.metavar:
            return f"{option} {'|'.join(map(str, action.choices))}"
        return f"{option} {self._metavar(action)}"

    # -- parsing and mistakes ---------------------------------------------------------

    def parse_args(self, args=None, namespace=None):
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

    def _check_value(self, action, value) -> None:
        if action.choices is not None and value not in action.choices:
            noun = (action.option_strings[-1].lstrip("-") if action.option_strings else action.dest).replace("-", " ")
            said = unknown_word(noun, value, action.choices)
            said += " choose " if said.endswith("?") else "; choose "
            raise argparse.ArgumentError(action, said + choice_list(action.choices))

    def error(self, message: str):
        raise UsageError(f"{_plain(message)} (see {self.prog} --help)")


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
