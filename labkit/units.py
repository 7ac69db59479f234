"""Sizes and durations as people write them, read one way everywhere in labkit.

Sizes follow the SI and IEC standards: ``KB``/``MB``/``GB``/``TB`` are powers of
ten (``64MB`` = 64,000,000 bytes), ``KiB``/``MiB``/``GiB``/``TiB`` powers of two
(``64MiB`` = 67,108,864 bytes); a bare number is bytes. The same text means the
same bytes in ``lab.train(max_memory=...)``, ``%lab train --max-memory`` and
``%lab bench --sizes``. Collective message sizes are powers of two, so a bench
range's ends are rounded to the nearest one (``4KB:4MB`` is 4 KiB to 4 MiB).

Durations: ``30ms``, ``0.5s`` or a plain number of seconds; ``off`` means none.

A simulated link (``lab.link``) is written as networks are: bandwidth in bits
per second with decimal prefixes (``100Mbit``, ``1Gbit``, ``100 Mbit/s``,
``500kbit``, ``100Mbps``; a lowercase ``b`` is a bit) or in bytes per second
with a capital ``B`` (``10MB/s`` = 80 Mbit/s, ``1MiB/s`` binary); latency with
its unit always (``20ms``, ``0.5s``, ``250us``), since a bare ``20`` could be
milliseconds or seconds.
"""

from __future__ import annotations

import math
import re
from typing import overload

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_EXAMPLE = "64MB (10^6 bytes each), 1.5GiB (2^30 bytes each) or 500000 (bytes)"


@overload
def parse_bytes(value: None, what: str = ...) -> None: ...
@overload
def parse_bytes(value: int | str, what: str = ...) -> int: ...


def parse_bytes(value: int | str | None, what: str = "a memory size") -> int | None:
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
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
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


# The longest time limit the lab takes. Limits reach the ranks' sockets and torch's stores as
# milliseconds in a C int (at most about 24.8 days); a week is far past any cell or run and
# safely below that, so an absurd limit is refused here instead of failing every later call.
MAX_SECONDS = 7 * 24 * 3600


def positive_seconds(name: str, value) -> float:
    """A time limit: a number of seconds above zero and at most ``MAX_SECONDS`` (a week)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a positive, finite number of seconds, at most {MAX_SECONDS} (7 days); "
                         f"got {value!r}")
    return float(value)


_SPAN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)?\s*$", re.IGNORECASE)
_SPAN_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_seconds(name: str, value) -> float:
    """A span of time as people write it: 90 (seconds), ``"90s"``, ``"30m"``, ``"1h"``, ``"2d"``; above zero,
    at most ``MAX_SECONDS``."""
    if isinstance(value, str):
        found = _SPAN.match(value)
        if found is None:
            raise ValueError(f"{name} is a span of time such as 3600, '90s', '30m', '1h' or '2d', got {value!r}")
        value = float(found.group(1)) * _SPAN_UNITS[found.group(2) and found.group(2).lower()]
    return positive_seconds(name, value)


_RATE = re.compile(r"^\s*(-?\d+(?:\.\d*)?|-?\.\d+)\s*([kmgt]?)(i?)(bits?|bytes?|b)\s*(/\s*s|ps)?\s*$", re.IGNORECASE)
_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_PREFIX = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
BANDWIDTH_EXAMPLE = "100Mbit (bits per second; also 1Gbit, 500kbit, 100 Mbit/s) or 10MB/s (bytes per second)"
_LATENCY = re.compile(r"^\s*(-?\d+(?:\.\d*)?|-?\.\d+)\s*(s|ms|us|\u00b5s|\u03bcs|ns)\s*$", re.IGNORECASE)
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ns": 1e-9}
LATENCY_EXAMPLE = "20ms, 0.5s or 250us"


def parse_bandwidth(value) -> float:
    """``"100Mbit"`` -> 1e8 bits per second; ``"10MB/s"`` -> 8e7. Refuses numbers without a unit."""
    match = _RATE.match(value) if isinstance(value, str) else None
    if not match:
        # A bare number could be bits or bytes per second, a factor of 8 apart: make it explicit.
        raise ValueError(f"write the bandwidth with its unit, like {BANDWIDTH_EXAMPLE}; got {value!r}")
    number, prefix, binary, unit, _ = match.groups()
    if binary and not prefix:
        raise ValueError(f"write the bandwidth like {BANDWIDTH_EXAMPLE}; got {value!r}")
    # "b" alone is a bit only in lower case (Mb, Mbps); "B" is a byte (MB/s), as networks write them.
    per_byte = unit.lower().startswith("byte") or unit == "B"
    scale = _BINARY_PREFIX[prefix.lower()] if binary else _PREFIX[prefix.lower()]
    bits = float(number) * scale * (8 if per_byte else 1)
    if not 0 < bits < math.inf:
        raise ValueError(f"a bandwidth must be above zero (a link that carries nothing never finishes), "
                         f"like {BANDWIDTH_EXAMPLE}; got {value!r}")
    return bits


def is_latency_text(text: str) -> bool:
    """Whether ``text`` is written as a latency (a number with a time unit), whatever its value."""
    return bool(_LATENCY.match(text))


def parse_latency(value) -> float:
    """``"20ms"`` -> 0.02 s; a number is seconds, text needs its unit (``20`` is refused)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _LATENCY.match(value) if isinstance(value, str) else None
        if not match:
            raise ValueError(f"write the latency with its unit, like {LATENCY_EXAMPLE}; got {value!r}")
        seconds = float(match.group(1)) * _LATENCY_UNITS[match.group(2).lower()]
    if not 0 <= seconds < math.inf:
        raise ValueError(f"a latency is a finite time >= 0, like {LATENCY_EXAMPLE}; got {value!r}")
    return seconds


def format_bandwidth(bits: float) -> str:
    """Bits per second in decimal units: ``format_bandwidth(1e8)`` -> ``'100 Mbit/s'``."""
    for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def format_seconds(seconds: float) -> str:
    """A short time in the unit that reads best: 0.02 -> ``'20 ms'``, 2.5e-4 -> ``'250 \u00b5s'``."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} \u00b5s"
