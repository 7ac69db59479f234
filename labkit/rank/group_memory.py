"""What torch remembers about process groups, forgotten when the lab rebuilds them.

Runs in the engines. ``RankRuntime.leave_group`` calls ``forget_old_groups``
after destroying a generation's groups, so nothing the next generation builds
can reach back to them.
"""

from __future__ import annotations

from labkit.torch_support.torch_internals import forget_dtensor_plans


def forget_old_groups() -> None:
    """Drop what torch remembers about process groups that no longer exist (after a rebuild).

    DTensor caches each operation's sharding plan, in C++ and in Python, keyed by
    the mesh without its groups: after a rebuild, a new mesh of the same shape
    would reuse plans that name the old groups (one rank fails to resolve them,
    another waits on the wrong group until the time limit). Meshes left on
    torch's mesh stack would likewise refer to destroyed groups.
    """
    forget_dtensor_plans()
