"""The private torch API labkit uses is all in labkit.torch_support.torch_internals (and its companion
torch_internals_models), and this torch has all of it."""

import re
from pathlib import Path

from labkit.torch_support.torch_internals import missing_internals

PACKAGE = Path(__file__).resolve().parents[3] / "labkit"
INTERNALS = {PACKAGE / "torch_support" / name for name in ("torch_internals.py", "torch_internals_models.py")}
# An underscored name reached on torch's modules or objects: torch._C, c10d._world, group._get_backend(...).
PRIVATE_USE = re.compile(r"\btorch\._(?!_)|distributed_c10d|\b_distributed_c10d\b|_mesh_resources|\b(group|inner|work|mesh|"
                         r"dist\.[A-Za-z]+)\._[a-z]")
# Method names a ProcessGroup/Work written in Python must define (torch calls them), and DTensor's logger name.
INTERFACE = re.compile(r"def _(allgather_base|reduce_scatter_base|source_rank)\b|self\.inner\._(allgather_base|"
                       r"reduce_scatter_base)\b")


def test_this_torch_has_every_internal_labkit_uses():
    assert missing_internals() == []


def test_no_module_but_torch_internals_reaches_into_torch():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path in INTERNALS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE_USE.search(code) and not INTERFACE.search(code):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert found == [], "private torch API outside labkit/torch_support/torch_internals.py:\n" + "\n".join(found)
