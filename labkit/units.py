"""Sizes and durations as people write them, read one way everywhere in labkit.

Sizes follow the SI and IEC standards: ``KB``/``MB``/``GB``/``TB`` are powers of
ten (``64MB`` = 64,000,000 bytes), ``KiB``/``MiB``/``GiB``/``TiB`` powers of two
(``64MiB`` = 67,108,864 bytes); a bare number is bytes. The same text means the
same bytes in ``lab.train(max_memory=...)``, ``%lab train --max-memory`` and
``%lab bench --sizes``. Collective message sizes are powers of two, so a bench
range's ends are rounded to the nearest one (``4KB:4MB`` is 4 KiB to 4 MiB).

Durations: ``30ms``, ``0.5s`` or a plain number of seconds; ``off`` means none.
"""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_EXAMPLE = "64MB (10^6 bytes each), 1.5GiB (2^30 bytes each) or 500000 (bytes)"


def parse_bytes(value, what: str = "a memory size") -> int | None:
    """``"64MB"`` -> 64_000_000, ``"64MiB"`` -> 67_108_864, a positive int stays, None stays None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise ValueError(f"{what} must be positive, got {value!r}")
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"{what} is written like {SIZE_EXAMPLE}; got {value!r}")
    count = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()])
    if count < 1:
        raise ValueError(f"{what} must be at least one byte, got {value!r}")
    return count


def format_bytes(count: float) -> str:
    """Decimal units, as sizes are written: ``format_bytes(64e6)`` -> ``'64.0 MB'``."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def format_binary(size: int) -> str:
    """A power-of-two message size in binary units: 4096 -> ``'4 KiB'``."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def nearest_power_of_two(count: int) -> int:
    return 2 ** max(0, round(math.log2(count)))


def power_of_two_range(text: str) -> list[int]:
    """``"1KB:16MB"`` -> every power of two from 1 KiB to 16 MiB (ends rounded to the nearest one)."""
    low, _, high = text.partition(":")
    low_bytes = nearest_power_of_two(parse_bytes(low.strip(), "a message size"))
    high_bytes = nearest_power_of_two(parse_bytes((high or low).strip(), "a message size"))
    if high_bytes < low_bytes:
        raise ValueError(f"the range {text!r} ends below where it starts: write low:high, e.g. 4KB:4MB")
    sizes, size = [], low_bytes
    while size <= high_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def parse_duration(text: str) -> float | None:
    """``30ms`` -> 0.03, ``0.5s`` or ``0.5`` -> 0.5, ``off`` (or 0) -> None."""
    word = str(text).strip().lower()
    if word in ("off", "0", "none"):
        return None
    scale = 1e-3 if word.endswith("ms") else 1.0
    try:
        value = float(word.removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        raise ValueError(f"write a duration like 30ms or 0.03s (or off), got {text!r}") from None
    if not 0 <= value < math.inf:
        raise ValueError(f"a duration is a finite number of seconds >= 0, got {text!r}")
    return value or None


def positive_seconds(name: str, value) -> float:
    """A time limit: a finite number of seconds above zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)
