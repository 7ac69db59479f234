"""A dead rank's log, kept beside the log of the rank that replaces it.

Runs in the notebook. Each rank of the lab's own launcher writes its output
(torch's C++ messages among it: why an abort happened) to ``rank{N}.log`` in the
lab's folder, and the process that replaces it writes to the same name. So when
a rank has ended, its log is moved aside first, to ``rank{N}.died-{k}.log``
(``k`` counts up), and the error names that file. A lab that loses one rank
again and again keeps the newest ``KEPT_PER_RANK`` of them.
"""

from __future__ import annotations

import os
import re

KEPT_PER_RANK = 3


def keep_rank_log(cluster, rank: int) -> str | None:
    """Move ended ``rank``'s log aside before a new process writes to its name; where it is now (None: no log
    of its own on this machine: another launcher's, or a joined rank's)."""
    if getattr(cluster, "workdir", None) is None or not cluster.launcher.hosted:
        return None
    record = cluster.records.get(rank)
    if record is not None and record.joined:
        return None
    return keep_dead_log(cluster.log_path(rank))


def kept_name(log: str, number: int) -> str:
    """``rank1.log`` -> ``rank1.died-{number}.log``, in the same folder."""
    stem, extension = os.path.splitext(log)
    return f"{stem}.died-{number}{extension}"


def keep_dead_log(log: str, kept_per_rank: int = KEPT_PER_RANK) -> str | None:
    """Move ``log`` (an ended rank's) aside; where it is now, or None when there was nothing to keep.

    Only the newest ``kept_per_rank`` logs moved aside for the same name stay."""
    try:
        if os.path.getsize(log) == 0:
            return None
    except OSError:  # no log here: written elsewhere (another launcher's), or moved aside already
        return None
    earlier = _kept_numbers(log)
    kept = kept_name(log, (earlier[-1] if earlier else 0) + 1)
    os.replace(log, kept)
    for number in earlier[:max(0, len(earlier) - kept_per_rank + 1)]:
        try:
            os.remove(kept_name(log, number))
        except OSError:
            pass
    return kept


def _kept_numbers(log: str) -> list[int]:
    """The numbers of the logs moved aside for ``log`` so far, oldest first."""
    folder, name = os.path.split(log)
    stem, extension = os.path.splitext(name)
    pattern = re.compile(rf"{re.escape(stem)}\.died-(\d+){re.escape(extension)}$")
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    return sorted(int(found.group(1)) for found in map(pattern.match, names) if found)
