"""What torch remembers about process groups, forgotten when the lab rebuilds them.

Runs in the engines. ``RankRuntime.leave_group`` calls ``forget_old_groups``
after destroying a generation's groups, so nothing the next generation builds
can reach back to them.
"""

from __future__ import annotations

import torch


def forget_old_groups() -> None:
    """Drop what torch remembers about process groups that no longer exist (after a rebuild).

    DTensor caches each operation's sharding plan, in C++ and in Python, keyed by
    the mesh without its groups: after a rebuild, a new mesh of the same shape
    would reuse plans that name the old groups (one rank fails to resolve them,
    another waits on the wrong group until the time limit). Meshes left on
    torch's mesh stack would likewise refer to destroyed groups.
    """
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    try:
        from torch.distributed.device_mesh import _mesh_resources
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(propagator, "propagate_op_sharding", None),
                   getattr(propagator, "_propagate_tensor_meta_cached", None)):
        for clear in (getattr(cached, "cache_clear", None), getattr(getattr(cached, "cache", None), "cache_clear", None)):
            if clear is not None:
                clear()
    if hasattr(_mesh_resources, "mesh_stack"):
        _mesh_resources.mesh_stack.clear()
