"""A model's settings checked against the kinds of their defaults, in the notebook, before any rank builds it.

``model_settings=dict(dim="abc")`` would otherwise reach torch on every rank
(``randn() received an invalid combination of arguments``); here it is refused
naming the setting, the kind it takes and an example (its default). The kind is
read from the default's value, so a plugin's settings are checked the same way
without declaring anything: a whole number takes a whole number, a number any
finite number, a word a word, a switch True or False, a tuple a tuple (or list)
of the kind of its items. A setting whose default is None takes anything.
"""

from __future__ import annotations

import math
from typing import Any

_KINDS = {bool: "True or False", int: "a whole number", float: "a finite number", str: "a word (a string)"}


def _fits(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, tuple):
        return isinstance(value, (tuple, list)) and (not default or all(_fits(item, default[0]) for item in value))
    return True


def _kind(default: Any) -> str:
    if isinstance(default, tuple):
        return f"a tuple of {_kind(default[0]).removeprefix('a ')}s" if default else "a tuple"
    return next((words for kind, words in _KINDS.items() if isinstance(default, kind)), type(default).__name__)


def check_setting_values(model: str, overrides: dict, defaults: dict) -> None:
    """ValueError naming the first setting in ``overrides`` whose value is not of its default's kind."""
    for name, value in overrides.items():
        default = defaults.get(name)
        if default is not None and not _fits(value, default):
            raise ValueError(f"model {model!r}: setting {name} is {_kind(default)}, got {value!r}; "
                             f"e.g. {name}={default!r}")
