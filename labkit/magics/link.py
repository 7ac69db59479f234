"""``%lab link``: its words read into a bandwidth and a latency for ``lab.link``, and what the link does said.

    %lab link 100Mbit 20ms     set it (either may be left out; "100 Mbit/s" and "20 ms" also read)
    %lab link off              remove it
    %lab link                  show it

Setting, checking and sending the link is ``labkit.runs.link``'s (``lab.link``);
this module only reads the words and prints the sentence.
"""

from __future__ import annotations

import re
from types import EllipsisType
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from labkit.runs.link import describe
from labkit.spec.errors import LabConfigError
from labkit.spec.link import OFF_WORDS
from labkit.units import is_latency_text

if TYPE_CHECKING:
    from labkit.lab import Lab

# A word that is only a number (its unit is the next word); a word with a time unit is a latency
# (units.is_latency_text), anything else with a unit a bandwidth.
_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$")
LINK_USAGE = "write %lab link 100Mbit 20ms (bandwidth, latency, either may be left out), %lab link off, or %lab link"

LinkWord = str | None | EllipsisType  # a setting, None for none, ... for "leave as it is"


def parse_words(words: list[str]) -> tuple[LinkWord, LinkWord]:
    """``%lab link``'s words -> (bandwidth, latency) for ``lab.link``; ``(..., ...)`` for none (show)."""
    if not words:
        return ..., ...
    if len(words) == 1 and words[0].lower() in OFF_WORDS:
        return None, None
    tokens: list[str] = []
    pending: str | None = None
    for word in words:  # "100 Mbit/s" and "20 ms" arrive as two words each
        if pending is not None:
            if _NUMBER.match(word):
                raise LabConfigError(f"{pending!r} needs its unit, e.g. {pending}ms (latency) or "
                                     f"{pending}Mbit (bandwidth): {LINK_USAGE}")
            tokens.append(pending + word)
            pending = None
        elif _NUMBER.match(word):
            pending = word
        else:
            tokens.append(word)
    if pending is not None:
        raise LabConfigError(f"{pending!r} needs its unit, e.g. {pending}ms (latency) or {pending}Mbit "
                             f"(bandwidth): {LINK_USAGE}")
    latencies = [token for token in tokens if is_latency_text(token)]
    bandwidths = [token for token in tokens if not is_latency_text(token)]
    if len(latencies) > 1 or len(bandwidths) > 1:
        raise LabConfigError(f"give at most one bandwidth and one latency, got {' '.join(words)!r}: {LINK_USAGE}")
    return (bandwidths[0] if bandwidths else None), (latencies[0] if latencies else None)


def link_command(lab: Lab, words: list[str]) -> None:
    """``%lab link [BANDWIDTH] [LATENCY] | off``: set it (or, alone, show it) and say what it does."""
    try:
        bandwidth, latency = parse_words(words)
        spec = lab.link(bandwidth, latency)
    except LabConfigError as error:
        raise UsageError(f"%lab link: {error}") from None
    if spec is not None or bandwidth is ...:  # a removal was said by lab.link itself
        print(describe(spec, lab.world_size))
