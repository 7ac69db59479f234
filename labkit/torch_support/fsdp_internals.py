"""The one use labkit makes of FSDP2's private state: the mesh a ``fully_shard`` module shards over.

Kept beside ``torch_internals`` (every other use of torch's private API, a file at its size limit) under the
same rule: nothing else in labkit reaches into torch, and ``missing_internals`` names what a new torch lacks.
torch offers no public call for an FSDP2 module's mesh; the watch on a loop the lab did not write needs its
size to count a replica's batch once (``rank.instruments.loop_watch.replica_copies``).
"""

from __future__ import annotations

from importlib import import_module


def missing_internals() -> list[str]:
    """The private names used here that this torch lacks (empty on a tested torch)."""
    fsdp_module = import_module("torch.distributed.fsdp").FSDPModule
    return [] if hasattr(fsdp_module, "_get_fsdp_state") else ["distributed.fsdp.FSDPModule._get_fsdp_state"]


def data_parallel_size(module) -> int | None:
    """Over how many ranks a data-parallel module (DDP, FSDP, ``fully_shard``) splits its data: the size of
    the group (or the FSDP2 mesh, all of its dimensions) it averages gradients over; None when unknown."""
    group = getattr(module, "process_group", None)  # DDP and FSDP1 keep theirs, public
    if group is not None:
        return group.size()
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 keeps its mesh in each module's parameter groups (a list of them, or one, by torch release); a
    # root that holds no parameter of its own has none, so the first sharded module's is taken.
    for part in module.modules():
        if not isinstance(part, FSDPModule):
            continue
        state = part._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for param_group in groups:
            return param_group.mesh_info.mesh.size()
    return None
