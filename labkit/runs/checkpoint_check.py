"""Whether a checkpoint is whole before the ranks load it, and what to load instead when it is not.

Checked before any rank drops the training state it holds. In the notebook:
``labkit.json`` is JSON whose every field a load reads is sound
(``checkpoint_meta``); every file it lists is there with its recorded size (a
checkpoint saved before checksums: DCP's ``.metadata`` can be read, every shard it
names is there with all its bytes, every rank's random state is there). Then on
the ranks, each hashing its share at once: every file's SHA-256 is the one its
save recorded (``checkpoint_sums``). A damaged checkpoint is refused naming the
file, the rank that wrote it and what is wrong, and the checkpoints beside it
that look whole to load instead.
"""

from __future__ import annotations

import json
import os

from labkit.spec.checkpoint_files import META_FILE
from labkit.spec.checkpoint_meta import looks_whole, meta_problem
from labkit.spec.checkpoint_sums import shares
from labkit.spec.errors import LabConfigError

SHOWN_OTHERS = 5  # the refusal lists this many of the whole checkpoints beside the damaged one


def others_beside(directory: str) -> list[str]:
    """The checkpoints in ``directory``'s folder other than it that look whole, by name (``looks_whole``:
    a sound labkit.json and its files there with their sizes; their bytes are checked when loaded)."""
    parent = os.path.dirname(directory)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(name for name in names if not name.startswith(".") and os.path.join(parent, name) != directory
                  and looks_whole(os.path.join(parent, name)))


def what_to_do(directory: str) -> str:
    others = others_beside(directory)
    if not others:
        return "save a new one (lab.save), or train again (checkpoint_every and checkpoint_dir keep several)"
    parent = os.path.dirname(directory)
    shown = ", ".join(others[-SHOWN_OTHERS:][::-1])
    more = f" and {len(others) - SHOWN_OTHERS} older" if len(others) > SHOWN_OTHERS else ""
    return (f"load another one, e.g. {os.path.join(parent, others[-1])} (beside it, these look whole by their labkit.json "
            f"and file sizes: {shown}{more})")


def damaged(directory: str, name: str, problem: str) -> LabConfigError:
    return LabConfigError(f"{os.path.join(directory, name)} {problem}: the checkpoint {directory} is damaged, so "
                          f"nothing was loaded (the ranks keep what they hold); {what_to_do(directory)}")


def read_meta(directory: str) -> dict:
    """The checked ``labkit.json`` of the checkpoint ``directory``: every field a load reads is sound."""
    try:
        with open(os.path.join(directory, META_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(directory, META_FILE, f"is not readable JSON ({type(error).__name__})") from None
    except OSError as error:
        raise damaged(directory, META_FILE, f"cannot be read ({error.strerror})") from None
    problem = meta_problem(meta)
    if problem:
        raise damaged(directory, META_FILE, problem)
    return meta


def _shard_sizes(directory: str) -> dict[str, int]:
    """Each shard file DCP's metadata names, and how many bytes it must hold at least."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise damaged(directory, ".metadata", "is missing (it says where every tensor is)")
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as error:  # any unpickling failure: the file is not what a save wrote
        raise damaged(directory, ".metadata", f"cannot be read ({type(error).__name__})") from None
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            sizes[name] = max(sizes.get(name, 0), offset + length)
    return sizes


def check_files(directory: str, meta: dict) -> None:
    """Refuse the checkpoint ``directory`` if a file a load reads is missing or cut short (its size
    against the one recorded; saved without checksums, against DCP's metadata)."""
    files = meta.get("files")
    if files is not None:
        for name, record in sorted(files.items()):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise damaged(directory, name, f"is missing (written by rank {record['rank']})")
            got = os.path.getsize(path)
            if got != record["bytes"]:
                shorter = "is cut short" if got < record["bytes"] else "has grown"
                raise damaged(directory, name, f"{shorter} ({got} of {record['bytes']} bytes, written by rank "
                                               f"{record['rank']})")
        return
    for name, size in sorted(_shard_sizes(directory).items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise damaged(directory, name, "is missing (a shard of the saved tensors)")
        got = os.path.getsize(path)
        if got < size:
            raise damaged(directory, name, f"is cut short ({got} of at least {size} bytes)")
    for rank in range(meta["world_size"]):
        name = f"random-state-rank{rank}.pt"
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise damaged(directory, name, f"is missing or empty (rank {rank}'s random state)")


def check_sums(directory: str, meta: dict, world_size: int, check_on_ranks) -> None:
    """Refuse the checkpoint ``directory`` if a file's bytes are not the ones its save recorded.

    ``check_on_ranks(shares)`` has every rank hash its share at once (``checkpoint_sums.mismatches``) and
    returns each rank's findings. A checkpoint saved before checksums is said once, and loads."""
    files = meta.get("files")
    if files is None:
        print(f"labkit: {directory} was saved without checksums (by an older labkit): its files were checked "
              "for presence and size only", flush=True)
        return
    found = [finding for findings in check_on_ranks(shares(files, world_size)) for finding in findings]
    if not found:
        return
    name, problem = min(found)
    others = f" ({len(found) - 1} more file{'s' if len(found) > 2 else ''} too)" if len(found) > 1 else ""
    raise damaged(directory, name, f"(written by rank {files[name]['rank']}) {problem}{others}")
