"""Whether a checkpoint is whole before the ranks load it, and what to load instead when it is not.

Checked in the notebook, before any rank drops the training state it holds:
``labkit.json`` is JSON with the fields a load needs; torch.distributed.checkpoint's
``.metadata`` can be read; every shard file it names is there with all its bytes;
every rank's random state is there. A damaged checkpoint is refused naming the file
and what is wrong with it, and the whole checkpoints beside it to load instead.
"""

from __future__ import annotations

import json
import os

from labkit.spec.checkpoint_files import META_FILE, is_complete
from labkit.spec.errors import LabConfigError

# What a load reads of labkit.json, and the type each must have.
NEEDED = {"settings": dict, "step": int, "world_size": int}
SHOWN_OTHERS = 5  # the refusal lists this many of the whole checkpoints beside the damaged one


def others_beside(directory: str) -> list[str]:
    """The complete checkpoints in ``directory``'s folder other than it, by name."""
    parent = os.path.dirname(directory)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(name for name in names if not name.startswith(".") and os.path.join(parent, name) != directory
                  and is_complete(os.path.join(parent, name)))


def what_to_do(directory: str) -> str:
    others = others_beside(directory)
    if not others:
        return "save a new one (lab.save), or train again (checkpoint_every and checkpoint_dir keep several)"
    parent = os.path.dirname(directory)
    shown = ", ".join(others[-SHOWN_OTHERS:][::-1])
    more = f" and {len(others) - SHOWN_OTHERS} older" if len(others) > SHOWN_OTHERS else ""
    return f"load another one, e.g. {os.path.join(parent, others[-1])} (complete ones beside it: {shown}{more})"


def damaged(directory: str, name: str, problem: str) -> LabConfigError:
    return LabConfigError(f"{os.path.join(directory, name)} {problem}: the checkpoint {directory} is damaged, so "
                          f"nothing was loaded (the ranks keep what they hold); {what_to_do(directory)}")


def read_meta(directory: str) -> dict:
    """The checked ``labkit.json`` of the checkpoint ``directory``."""
    try:
        with open(os.path.join(directory, META_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(directory, META_FILE, f"is not readable JSON ({type(error).__name__})") from None
    except OSError as error:
        raise damaged(directory, META_FILE, f"cannot be read ({error.strerror})") from None
    if not isinstance(meta, dict):
        raise damaged(directory, META_FILE, f"holds a {type(meta).__name__}, not the checkpoint's record")
    missing = [name for name in NEEDED if name not in meta]
    if missing:
        raise damaged(directory, META_FILE, f"lacks {', '.join(missing)}, which a load needs")
    wrong = [name for name, kind in NEEDED.items() if not isinstance(meta[name], kind) or isinstance(meta[name], bool)]
    if wrong:
        raise damaged(directory, META_FILE, f"has {', '.join(wrong)} of the wrong type")
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
    """Refuse the checkpoint ``directory`` if a file a load reads is missing or cut short."""
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
