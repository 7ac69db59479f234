"""What a labkit checkpoint is on disk, and which paths a save may use.

A checkpoint is a folder holding only the files a save writes: ``labkit.json``
(written last: its presence marks a complete checkpoint), torch.distributed.
checkpoint's ``.metadata`` and ``__R_N.distcp`` shards, and every rank's
``random-state-rankR.pt``. A save replaces only such a folder (or an empty one)
and removes only such files, so nothing of the user's is ever deleted or moved.

Beside a checkpoint ``NAME`` a save works in ``.partial-NAME-XXXXXXXX`` and, where
the system cannot exchange two folders at once, sets the old one aside as
``.replaced-NAME-XXXXXXXX``. A kill can leave these behind; ``recoverable`` says
which of them is the whole checkpoint when ``NAME`` itself is missing, and
``tidy`` (the next save) puts that one in place and removes the rest.
"""

from __future__ import annotations

import json
import os
import re
import uuid

META_FILE = "labkit.json"
# Every name a save writes, DCP's temporary ones included: a checkpoint holds nothing else.
_CHECKPOINT_FILE = re.compile(r"labkit\.json(\.tmp)?|(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp"
                              r"|random-state-rank\d+\.pt")
_LEFTOVER = re.compile(r"\.(?P<kind>partial|replaced)-(?P<name>.+)-[0-9a-f]{8}")
SHOWN_ENTRIES = 3  # a refusal names this many of what is in the way, then counts the rest


def is_checkpoint_file(name: str) -> bool:
    return _CHECKPOINT_FILE.fullmatch(name) is not None


def is_complete(path: str) -> bool:
    """A folder whose ``labkit.json`` was written: every rank's shards are in it."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def foreign_entries(path: str) -> list[str]:
    """What in the folder ``path`` a save did not write (sub-folders end in '/'), sorted."""
    names = []
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            names.append(entry.name + "/")
        elif not (is_checkpoint_file(entry.name) and entry.is_file(follow_symlinks=False)):
            names.append(entry.name)
    return sorted(names)


def describe_entries(names: list[str]) -> str:
    """'a, b, c and 2 more (5 entries)': enough to recognise a folder, short enough for one line."""
    shown = ", ".join(names[:SHOWN_ENTRIES])
    more = f" and {len(names) - SHOWN_ENTRIES} more" if len(names) > SHOWN_ENTRIES else ""
    return f"{shown}{more} ({len(names)} {'entry' if len(names) == 1 else 'entries'})"


def is_checkpoint(path: str) -> bool:
    """A folder a save wrote: complete, and holding nothing else."""
    return is_complete(path) and not os.path.islink(path) and not foreign_entries(path)


def _enclosing_problem(target: str) -> str | None:
    """Why no folder can be made at ``target`` because of what is above it, if something is."""
    above = os.path.dirname(target)
    while True:
        if os.path.lexists(above) and not os.path.isdir(above):
            return f"{above} is a file, so {target} cannot be a folder: give another path"
        if is_complete(above):
            beside = os.path.join(os.path.dirname(above), os.path.basename(target))
            return (f"{target} is inside the checkpoint {above}, which holds only its own files (and would lose "
                    f"yours when saved again): save beside it, e.g. to {beside}")
        parent = os.path.dirname(above)
        if parent == above:
            return None
        above = parent


def save_refusal(target: str) -> str | None:
    """Why a save must not write at ``target`` (an absolute path), in words with what to do; None if it may.

    It may when nothing is there, an empty folder is there, or a labkit checkpoint is (which it replaces)."""
    if os.path.islink(target):
        return (f"{target} is a symbolic link (to {os.readlink(target)}): a save replaces a folder and would not "
                "follow the link; give the folder itself, or another path")
    problem = _enclosing_problem(target)
    if problem:
        return problem
    if not os.path.lexists(target):
        return None
    if not os.path.isdir(target):
        return (f"{target} is a file, not a checkpoint: a save replaces only a checkpoint labkit wrote (or an "
                "empty folder); give another path, or move the file away first")
    foreign = foreign_entries(target)
    if foreign:
        return (f"{target} holds {describe_entries(foreign)}, not a labkit checkpoint: a save replaces only a "
                f"checkpoint labkit wrote (or an empty folder); give another path (a new folder, e.g. "
                f"{os.path.join(target, 'checkpoint')}), or move these away first")
    if os.listdir(target) and not is_complete(target):
        return (f"{target} holds checkpoint files but no {META_FILE}: it is not a complete labkit checkpoint (a "
                "copy cut short, or written by another program), so a save leaves it alone; give another path, "
                "or remove it first")
    return None


# -- the work folders beside a checkpoint -------------------------------------------------------------------------


def partial_directory(target: str, tag: str | None = None) -> str:
    """Where a save writes before it is complete: beside ``target``, never mistaken for it.

    ``tag`` (8 hex digits) when every rank must name it alike without talking; a fresh one otherwise."""
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".partial-{name}-{tag or uuid.uuid4().hex[:8]}")


def aside_directory(partial: str) -> str:
    """Where the old checkpoint waits while the new one is renamed into place (no exchange available)."""
    parent, name = os.path.split(partial)
    return os.path.join(parent, ".replaced-" + name[len(".partial-"):])


def leftovers(target: str) -> list[str]:
    """The work folders that saves to ``target`` left beside it."""
    parent, name = os.path.split(os.path.abspath(target))
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry)
        path = os.path.join(parent, entry)
        if match and match["name"] == name and os.path.isdir(path) and not os.path.islink(path):
            found.append(path)
    return sorted(found)


def recoverable(target: str) -> str | None:
    """When ``target`` is missing, the whole checkpoint a cut-short save left beside it, if any.

    A complete ``.partial-`` folder is the newer: ``labkit.json`` is written into it only once every
    rank has written, and its rename into place was all that was left. A ``.replaced-`` one is the
    checkpoint it was replacing."""
    if os.path.lexists(target):
        return None
    complete = [path for path in leftovers(target) if is_checkpoint(path)]

    def order(path):
        kind = _LEFTOVER.fullmatch(os.path.basename(path))["kind"]
        return kind == "partial", os.path.getmtime(os.path.join(path, META_FILE))

    return max(complete, key=order) if complete else None


def remove_checkpoint(path: str) -> bool:
    """Remove the checkpoint files in ``path``, and the folder if that empties it; whether it is gone.

    Anything else found there stays where it is: only what a save writes is ever removed."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return True
    # labkit.json first: a folder cut short mid-removal must not look complete.
    for entry in sorted(entries, key=lambda entry: entry.name != META_FILE):
        if is_checkpoint_file(entry.name) and entry.is_file(follow_symlinks=False):
            os.remove(entry.path)
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def tidy(target: str) -> None:
    """What a cut-short save to ``target`` left: its whole checkpoint put back in place, the rest removed."""
    whole = recoverable(target)
    if whole is not None:
        os.rename(whole, target)
    for path in leftovers(target):
        remove_checkpoint(path)


def read_json(path: str) -> dict | None:
    """A checkpoint's ``labkit.json`` as a dict; None when it cannot be read as one."""
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None
