"""A simulated slow link between the ranks: what each collective costs on it (pure arithmetic).

``lab.link(bandwidth="100Mbit", latency="20ms")`` makes the lab's collectives
behave as if the ranks talked over a wide-area link. Nothing touches the host's
network: each rank's process groups complete their work later (see
``labkit.rank.instruments.slow_link``), by the time this model gives.

The model. A collective over ``n`` ranks is a number of sequential message
rounds; each round pays the latency once, and the bytes a rank puts on the wire
pay the bandwidth::

    added seconds = latency * rounds + 8 * wire_bytes / bandwidth

with ring algorithms, as NCCL uses for large messages (``B`` is
the buffer as the recorder counts it: the whole tensor for all-reduce and
broadcast, the gathered output for all-gather, the full input for
reduce-scatter, as nccl-tests does):

- all-reduce: a ring (reduce-scatter, then all-gather): ``2(n-1)`` rounds,
  ``2(n-1)/n * B`` bytes;
- all-gather, reduce-scatter: a ring, ``n-1`` rounds, ``(n-1)/n * B``;
- all-to-all: pairwise exchange, ``n-1`` rounds, ``(n-1)/n * B``;
- broadcast: a binomial tree, ``ceil(log2 n)`` rounds, each carrying the whole
  buffer along the critical path: ``ceil(log2 n) * B``;
- barrier: dissemination, ``ceil(log2 n)`` rounds, no payload;
- send / recv: one round, the message ``B``.

On one rank (``n = 1``) a collective crosses no link and costs nothing. The
time is added to the real collective's, not folded into it: on this machine
the real part is small next to a wide-area link's. A rank has one link: its
collectives wait for it in the order they complete (a second DDP bucket is not
carried while the first one still is), so the costs of collectives issued
together add up, as they would on one network interface.

Torch-free: the notebook checks a setting with it, the ranks compute delays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.spec.errors import LabConfigError
from labkit.units import format_bandwidth, format_bytes, format_seconds, parse_bandwidth, parse_latency

OFF_WORDS = ("off", "none")


def _ring(n: int) -> tuple[int, float]:
    return n - 1, (n - 1) / n


def _tree_rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def rounds_and_wire_bytes(kind: str, nbytes: int, n: int) -> tuple[int, float]:
    """Sequential message rounds of collective ``kind`` over ``n`` ranks, and the bytes one rank sends."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0, 0.0
    if kind == "all_reduce":
        rounds, share = _ring(n)
        return 2 * rounds, 2 * share * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        rounds, share = _ring(n)
        return rounds, share * nbytes
    if kind == "broadcast":
        rounds = _tree_rounds(n)
        return rounds, float(rounds * nbytes)
    if kind == "barrier":
        return _tree_rounds(n), 0.0
    if kind in ("send", "recv"):
        return 1, float(nbytes)
    raise ValueError(f"the link model knows no collective {kind!r}")


@dataclass(frozen=True)
class LinkSpec:
    """A link's bandwidth (bits per second; None: unlimited) and latency (seconds per message round)."""

    bandwidth: float | None = None
    latency: float = 0.0

    @classmethod
    def parse(cls, bandwidth=None, latency=None) -> "LinkSpec | None":
        """From what people write (``"100Mbit"``, ``"20ms"``); None (or ``"off"``) for both: no link.

        A part left out is ideal: ``parse(latency="50ms")`` is a link of unlimited bandwidth."""
        bandwidth = None if _is_off(bandwidth) else bandwidth
        latency = None if _is_off(latency) else latency
        if bandwidth is None and latency is None:
            return None
        try:
            bits = None if bandwidth is None else parse_bandwidth(bandwidth)
            seconds = 0.0 if latency is None else parse_latency(latency)
        except ValueError as error:
            raise LabConfigError(f"{error}. For example: lab.link(bandwidth='100Mbit', latency='20ms'), "
                                 "or lab.link('off')") from None
        if bits is None and seconds == 0:
            return None  # nothing added: the fast path
        return cls(bits, seconds)

    def seconds(self, kind: str, nbytes: int, n: int) -> float:
        """What the link adds to one collective ``kind`` of ``nbytes`` (see the table above) over ``n`` ranks."""
        rounds, wire = rounds_and_wire_bytes(kind, nbytes, n)
        carry = 0.0 if self.bandwidth is None else 8 * wire / self.bandwidth
        return self.latency * rounds + carry

    def describe(self) -> str:
        speed = "unlimited bandwidth" if self.bandwidth is None else format_bandwidth(self.bandwidth)
        delay = f"{format_seconds(self.latency)} latency" if self.latency else "no latency"
        return f"{speed}, {delay}"

    def example(self, n: int, nbytes: int = 10**6) -> str:
        """One all-reduce on this link, in words: what a DDP bucket of ``nbytes`` pays over ``n`` ranks."""
        added = format_seconds(self.seconds("all_reduce", nbytes, n))
        return f"an all-reduce of {format_bytes(nbytes)} over {n} ranks takes {added} longer"

    def __str__(self) -> str:
        return f"simulated link: {self.describe()}"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def _is_off(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in OFF_WORDS)
