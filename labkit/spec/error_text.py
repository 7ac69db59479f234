"""When two ranks' errors are the same error: their texts compared without what differs by process.

Ranks that fail the same way rarely say it in the same letters: object reprs
carry memory addresses (``<ProcessGroup object at 0x7f3a...>``), sockets carry
the ephemeral port each rank happened to get, torch prefixes the reporting
rank (``[rank3]:``), and temporary files have random names. ``comparable``
rewrites those parts to fixed placeholders, so that equal errors compare equal;
``group_alike`` groups ranks by it and keeps the lowest rank's real text to show.

What is rewritten is deliberately narrow. Whatever a reader could need to tell
two errors apart stays: line numbers, exception types, host addresses (which
peer), tensor values and sizes, short numbers, and rank numbers other than the
reporter's own as torch prefixes it (``Rank 1 is running collective ...`` against
``Rank 2 ...`` names different calls; ``rank 3 is out of data`` written by user
code is the user's own words).
"""

from __future__ import annotations

import re

_IPV4 = r"\d{1,3}(?:\.\d{1,3}){3}"
_HOST = rf"(?:{_IPV4}|\[[0-9A-Fa-f:.]*[:.][0-9A-Fa-f:.]*\]|localhost)"  # IPv4, [IPv4] or [IPv6], localhost

# (pattern, replacement): each a part of a text that differs between processes doing the same thing.
_VOLATILE = [
    # Memory addresses: object reprs ("<... object at 0x7f3a...>"), and any 0x number wider than
    # 32 bits (pointers, thread ids "Thread 0x00007f..."). A short 0x number (an error code, a
    # CRC) is not an address and may be the point of the message.
    (re.compile(r"\b(at\s+)0x[0-9A-Fa-f]+\b"), r"\g<1>0x…"),
    (re.compile(r"\b0x[0-9A-Fa-f]{9,}\b"), "0x…"),
    # Ports after an address: the ephemeral end of each rank's socket ("[127.0.0.1]:45123",
    # "127.0.0.1:45123", "(127.0.0.1, 29500)"); the address itself says which peer and stays.
    (re.compile(rf"({_HOST}):\d{{1,5}}\b"), r"\1:<port>"),
    (re.compile(rf"(\(\s*'?{_HOST}'?\s*,\s*)\d{{1,5}}(\s*\))"), r"\1<port>\2"),
    (re.compile(r"\b([Pp]ort\s*[=:]?\s*)\d{2,5}\b"), r"\1<port>"),
    # Process ids, where the text says it is one ("pid 1234", "pid=1234", the DataLoader's
    # "(pid(s) 1234, 1240)", and the CUDA out-of-memory message's "Process 1234 has 2.00 GiB").
    (re.compile(r"\b((?:pid|PID|Pid)(?:\(s\))?\s*[=:]?\s*)\d+(?:,\s*\d+)*"), r"\1<pid>"),
    (re.compile(r"\b(Process )\d+( has [\d.]+ [KMGT]?i?B memory in use)"), r"\1<pid>\2"),
    # Ids and pointers named as such ("id=140234...", "ident: ...", "data_ptr=..."), then any
    # decimal of 12 digits or more: ids, pointers and thread idents printed in decimal, nanosecond
    # clocks. Sizes that long are rare; shorter numbers are kept, as they may be the difference.
    (re.compile(r"\b((?:id|ident|tid|ptr|data_ptr|pointer)\s*[=:]\s*)\d{5,}\b"), r"\1<id>"),
    (re.compile(r"(?<![\d.])\d{12,}(?!\d)"), "<id>"),
    # Temporary names: Python's tempfile ("/tmp/tmpab12cd34", "pymp-", the lab's "labkit-...-")
    # and torchelastic's; 8 random characters after the prefix.
    (re.compile(r"(?<=/)(tmp|pymp-|torchelastic_|labkit-(?:[a-z]+-)*)[a-z0-9_]{8}(?![a-z0-9_])"), r"\1<random>"),
    # The lab's cell names: the same cell on every rank, its number counted per process.
    (re.compile(r"<lab\.run_cell \d+>"), "<lab.run_cell N>"),
    (re.compile(r"<lab cell In\[\d+\]>"), "<lab cell In[N]>"),
    # Clock times to the fraction of a second (log prefixes) and how long a watchdog waited past
    # its limit ("ran for 600034 milliseconds before timing out"): when, not what.
    (re.compile(r"\b\d{2}:\d{2}:\d{2}[.,]\d+\b"), "<time>"),
    (re.compile(r"\b(ran for )\d+( milliseconds)"), r"\1<n>\2"),
    # A dead rank's kept log (``cluster.rank_logs``): how many times that rank died before.
    (re.compile(r"(\.died-)\d+(\.log)\b"), r"\1<n>\2"),
]

# Where torch names the rank that reports ("[rank3]:", "[Rank 3]", "[PG ID 0 PG GUID 0 Rank 3]",
# DDP's "did not receive grad for rank 3:"): rewritten only when it is the reporter's own rank,
# so that the same error from ranks 0 and 3 compares equal while a message naming a peer does not.
_OWN_RANK = [
    re.compile(r"(\[(?:PG [^\]]*?)?[Rr]ank\s?)(\d+)(\])"),
    re.compile(r"(did not receive grad for rank )(\d+)(:)"),
    re.compile(r"(/rank)(\d+)(\.died-)"),  # its own kept log: ranks that died alike are told once, with the first's
]


def comparable(text: str, rank: int | None = None) -> str:
    """``text`` with its process-specific parts as placeholders; ``rank``: the rank that reported it."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    if rank is not None:
        def own_rank(match: re.Match) -> str:
            number = "<own>" if int(match.group(2)) == rank else match.group(2)
            return f"{match.group(1)}{number}{match.group(3)}"

        for pattern in _OWN_RANK:
            text = pattern.sub(own_rank, text)
    return text


def group_alike(texts: dict[int, str]) -> list[tuple[list[int], str, bool]]:
    """Ranks whose texts are alike, in order of their lowest rank: each group's ranks, the lowest
    rank's real text (to show), and whether all were equal to the letter."""
    groups: dict[str, tuple[list[int], str, bool]] = {}
    for rank in sorted(texts):
        key = comparable(texts[rank], rank)
        if key in groups:
            ranks, shown, exact = groups[key]
            ranks.append(rank)
            groups[key] = (ranks, shown, exact and texts[rank] == shown)
        else:
            groups[key] = ([rank], texts[rank], True)
    return list(groups.values())
