"""Many ranks' output made readable: what several ranks printed alike is shown once.

``group_blocks`` cuts the ranks' item sequences (``rank_items``) into blocks, each a run of
items and the ranks that produced exactly it:

- what every rank produced at the start and at the end alike is one block of all the ranks
  (``[ranks 0-7] loading``);
- in between, when every rank produced as many items, they are compared place by place: a run
  of places where all ranks agree is one shared block, a run where they differ is shown rank by
  rank (ranks whose run is the same share one block);
- otherwise the ranks whose middle part is the same share a block, in rank order.

So 8 ranks printing one line print it once, labelled ``[ranks 0-7]``, and output that differs
stays with its rank, each rank's items still in the rank's own order.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.views.rank_items import Item, item_text

Block = tuple[list[int], list[Item]]


def rank_label(ranks: Sequence[int], stream: str = "stdout") -> str:
    """``[rank 3]``, ``[ranks 0-3]``, ``[ranks 0,2,5-7]``; ``:stderr`` for the other stream."""
    ranks = sorted(ranks)
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    suffix = "" if stream == "stdout" else f":{stream}"
    return f"[rank{'s' if len(ranks) > 1 else ''} {','.join(spans)}{suffix}]"


def _by_sequence(ranks: list[int], runs: dict[int, list[Item]]) -> list[Block]:
    """Ranks whose run is the same share a block; blocks in the order of their first rank; empty runs dropped."""
    blocks: list[Block] = []
    for rank in ranks:
        run = runs[rank]
        if not run:
            continue
        for members, items in blocks:
            if items == run:
                members.append(rank)
                break
        else:
            blocks.append(([rank], run))
    return blocks


def group_blocks(items: dict[int, list[Item]]) -> list[Block]:
    """The blocks of ``items`` (rank -> its items), as the module's docstring says."""
    ranks = sorted(items)
    if not ranks:
        return []
    sequences = [items[rank] for rank in ranks]
    shortest = min(len(sequence) for sequence in sequences)
    head = 0
    while head < shortest and all(sequence[head] == sequences[0][head] for sequence in sequences):
        head += 1
    tail = 0
    while tail < shortest - head and all(sequence[-1 - tail] == sequences[0][-1 - tail] for sequence in sequences):
        tail += 1
    blocks: list[Block] = []
    if head:
        blocks.append((list(ranks), sequences[0][:head]))
    middles = {rank: items[rank][head:len(items[rank]) - tail] for rank in ranks}
    lengths = {len(middle) for middle in middles.values()}
    if len(ranks) > 1 and len(lengths) == 1:
        blocks += _place_by_place(ranks, middles, lengths.pop())
    else:
        blocks += _by_sequence(ranks, middles)
    if tail:
        blocks.append((list(ranks), sequences[0][len(sequences[0]) - tail:]))
    return blocks


def _place_by_place(ranks: list[int], middles: dict[int, list[Item]], length: int) -> list[Block]:
    blocks: list[Block] = []
    start = 0
    while start < length:
        alike = all(middles[rank][start] == middles[ranks[0]][start] for rank in ranks)
        end = start + 1
        while end < length and all(middles[rank][end] == middles[ranks[0]][end] for rank in ranks) == alike:
            end += 1
        if alike:
            blocks.append((list(ranks), middles[ranks[0]][start:end]))
        else:
            blocks += _by_sequence(ranks, {rank: middles[rank][start:end] for rank in ranks})
        start = end
    return blocks


def blocks_text(blocks: list[Block], stream: str = "stdout") -> str:
    """The blocks as labelled lines of text (each display by its text form), ending with a newline."""
    lines = [f"{rank_label(ranks, stream)} {line}" for ranks, run in blocks for item in run for line in item_text(item)]
    return "\n".join(lines) + ("\n" if lines else "")
