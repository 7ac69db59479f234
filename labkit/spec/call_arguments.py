"""What a call names, checked before anything reaches a rank: which ranks, which seed.

Pure checks on plain values (no processes), shared by ``Lab`` and the ``Session``; each
refusal is a ``LabConfigError`` that gives the allowed range.
"""

from __future__ import annotations

from labkit.spec.errors import LabConfigError

LARGEST_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit integer


def chosen_ranks(ranks, world_size: int) -> list[int]:
    """The ranks ``ranks`` names (None: all, one rank number, or a list of them), sorted, in a world of
    ``world_size``."""
    if ranks is None:
        return list(range(world_size))
    given = [ranks] if isinstance(ranks, int) and not isinstance(ranks, bool) else ranks
    try:
        listed = list(given)
    except TypeError:
        listed = []  # not a list of ranks: refused below, as an empty one is
    wrong = not listed or any(isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size
                              for rank in listed)
    if wrong:
        raise LabConfigError(f"ranks is a rank number or a list of them, each between 0 and {world_size - 1}, "
                             f"got {ranks!r}")
    return sorted(set(listed))


def check_seed(value, same, world_size: int) -> None:
    """A seed every rank can take: ``value + rank`` (or ``value`` everywhere with ``same``) within range."""
    if not isinstance(same, bool):
        raise LabConfigError(f"same is True or False, got {same!r}")
    # Each rank takes value + rank (unless same): every rank's seed must be in range, the last one too.
    last = 0 if same else max(0, world_size - 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LARGEST_SEED - last:
        most = "2**63 - 1" if not last else f"2**63 - {last + 1} (rank {last} takes seed + {last})"
        raise LabConfigError(f"a seed is an integer from 0 to {most}, got {value!r}")
