"""What a sound ``labkit.json`` holds, and a quick look at whether a checkpoint folder is whole.

``labkit.json`` is a plain file a person can open and edit, so a load reads
nothing of it on trust: ``meta_problem`` names the first field whose value no
save writes (``step -5``, a ``world_size`` of 0, settings without a strategy, a
mesh that does not multiply to the world size, a checksum record that is not
one), in words that fit after the file's path. ``looks_whole`` is the cheap check
used to list the checkpoints a refusal suggests instead: a sound ``labkit.json``
and every file it lists there with its size, without reading the shards.
"""

from __future__ import annotations

import math
import os
import re

from labkit.spec.checkpoint_files import META_FILE, is_checkpoint_file, is_complete, read_json

NEEDED = ("settings", "step", "world_size")  # what a load reads of labkit.json
MOST_RANKS = 1 << 20  # far above any lab: a larger world_size is an edit, not a save
SHOWN_CHARACTERS = 60  # a value is quoted up to this long in a refusal
DIGEST = "sha256"  # the checksum each file's record carries (``sha256sum`` checks it by hand)
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_RANDOM_STATE = re.compile(r"random-state-rank(\d+)\.pt")


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS - 3] + "..."


def _whole_number(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value


def meta_problem(meta: object) -> str | None:
    """What in ``meta`` (a checkpoint's labkit.json, parsed) no save writes, said after the file's name
    ("has step -5, ..."); None when every field a load reads is sound."""
    if not isinstance(meta, dict):
        return f"holds a {type(meta).__name__}, not the checkpoint's record (a JSON object)"
    missing = [name for name in NEEDED if name not in meta]
    if missing:
        return f"lacks {', '.join(missing)}, which a load needs"
    step, world_size, settings = meta["step"], meta["world_size"], meta["settings"]
    if not _whole_number(step, 0):
        return f"has step {shown(step)}, which no save writes (the step is a whole number, 0 or more, e.g. 120)"
    if not _whole_number(world_size, 1) or world_size > MOST_RANKS:
        return (f"has world_size {shown(world_size)}, which no save writes (the number of ranks that saved it, "
                f"1 to {MOST_RANKS}, e.g. 4)")
    if not isinstance(settings, dict):
        return f"has settings {shown(settings)}, which no save writes (the run's settings, a JSON object)"
    strategy = settings.get("strategy")
    if "strategy" not in settings:
        return "has settings without a strategy, which a load needs (e.g. \"strategy\": \"fsdp\")"
    if not isinstance(strategy, str) or not strategy.strip():
        return f"has strategy {shown(strategy)}, which no save writes (a strategy's name, e.g. \"fsdp\")"
    if "model" in settings and not isinstance(settings["model"], str):
        return f"has model {shown(settings['model'])}, which no save writes (a model's name, e.g. \"gpt\")"
    return _mesh_problem(meta.get("mesh"), world_size) or _files_problem(meta.get("files"), world_size)


def _mesh_problem(mesh: object, world_size: int) -> str | None:
    if mesh is None:
        return None
    if not (isinstance(mesh, dict) and all(isinstance(name, str) and _whole_number(size, 1)
                                           for name, size in mesh.items())):
        return f"has mesh {shown(mesh)}, which no save writes (axis names and sizes, e.g. {{\"dp\": {world_size}}})"
    if math.prod(mesh.values()) != world_size:
        return (f"has mesh {shown(mesh)} for world_size {world_size}: the axes' sizes multiply to the number of "
                "ranks in every checkpoint a save writes, so one of the two was changed")
    return None


def _files_problem(files: object, world_size: int) -> str | None:
    """What is wrong with the checksum records (``files``: name -> {rank, bytes, sha256}), if anything."""
    if files is None:
        return None  # saved before checkpoints carried checksums
    if not isinstance(files, dict):
        return f"has files {shown(files)}, which no save writes (each file's rank, size and {DIGEST})"
    for name, record in files.items():
        sound = (isinstance(name, str) and is_checkpoint_file(name) and name != META_FILE
                 and isinstance(record, dict) and _whole_number(record.get("rank"), 0)
                 and _whole_number(record.get("bytes"), 0)
                 and isinstance(record.get(DIGEST), str) and _HEX_DIGEST.fullmatch(record[DIGEST]) is not None)
        if not sound:
            return (f"has the files entry {shown(name)}: {shown(record)}, which no save writes (e.g. "
                    f"\"__0_0.distcp\": {{\"rank\": 0, \"bytes\": 1961, \"{DIGEST}\": \"<64 hex digits>\"}})")
    states = sorted(int(match[1]) for match in map(_RANDOM_STATE.fullmatch, files) if match)
    if states != list(range(world_size)):
        return (f"has world_size {world_size}, but the files it lists hold the random states of "
                f"{len(states)} ranks: one of the two was changed")
    return None


def looks_whole(path: str) -> bool:
    """A quick look at the folder ``path``, reading only its labkit.json: complete, the record sound, and
    every file it lists there with its recorded size (saved without checksums: DCP's ``.metadata`` and
    every rank's random state there). The shards' bytes are checked only when it is loaded."""
    if not is_complete(path):
        return False
    meta = read_json(path)
    if meta is None or meta_problem(meta) is not None:
        return False
    files = meta.get("files")
    if files is None:
        needed = [".metadata"] + [f"random-state-rank{rank}.pt" for rank in range(meta["world_size"])]
        return all(os.path.isfile(os.path.join(path, name)) for name in needed)
    for name, record in files.items():
        try:
            if os.path.getsize(os.path.join(path, name)) != record["bytes"]:
                return False
        except OSError:
            return False
    return True
