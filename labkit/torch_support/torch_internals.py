"""Every use labkit makes of torch's private API, in one place.

Runs in the engines. The lab does things torch offers no public call for: it puts a timed stand-in in a process
group's place (under the same name, in torch's registry of groups), changes the time limit of every group at each
cell, swaps the default group while a slow link is simulated, aborts the groups of a failing nccl rank, clears what
DTensor and the mesh stack cached about groups that a rebuild destroyed, queues a callback at the end of backward,
and finds where a DTensor's shard lies in the whole tensor. What it does to models' per-iteration state after a
failed cell (DDP's reducer, FSDP2's iteration) is in ``torch_internals_models``, this file's companion. Each of these reaches into
``torch.distributed.distributed_c10d``, ``torch._C`` or underscored names, which change between torch releases
without notice.

So they live here (and in that companion) and nowhere else: a new torch is checked against this file (``missing_internals`` lists what it
lacks; a test asserts it lacks nothing), and ``labkit.spec.torch_version`` names this file when the installed torch
is not a tested one. Code elsewhere calls the functions below and never an underscored name of torch's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from datetime import timedelta
from importlib import import_module
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_native
from torch.distributed import distributed_c10d as c10d

from labkit.torch_support.torch_internals_models import model_internals

if TYPE_CHECKING:  # a NewType of str in torch's stubs, not a name every torch has at run time
    from torch.distributed.distributed_c10d import GroupName
# torch's logger for DTensor's redistribution, which warns at every uneven shard of the zoo's models.
DTENSOR_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"

# The per-group tables of torch's registry that a stand-in must appear in, as its real group does.
_WORLD_TABLES = ("pg_map", "pg_names", "pg_group_ranks")


def missing_internals() -> list[str]:
    """The private names labkit uses that this torch lacks (empty on a tested torch)."""
    checks: dict[str, Callable[[], object]] = {
        "distributed_c10d._world": lambda: c10d._world,
        **{f"distributed_c10d._world.{table}": _world_table(table)
           for table in (*_WORLD_TABLES, "pg_backend_config", "pg_to_tag", "tags_to_pg", "default_pg")},
        "distributed_c10d._update_default_pg": lambda: c10d._update_default_pg,
        "distributed_c10d._abort_process_group": lambda: c10d._abort_process_group,
        "distributed_c10d._new_process_group_helper": lambda: c10d._new_process_group_helper,
        "distributed_c10d._world.group_count": lambda: c10d._world.group_count,
        "distributed_c10d._unregister_all_process_groups": lambda: c10d._unregister_all_process_groups,
        **model_internals(),  # torch_internals_models: DDP's reducer, FSDP2's iteration
        "_C._distributed_c10d._register_process_group": lambda: c10d_native._register_process_group,
        "_C._distributed_c10d._resolve_process_group": lambda: c10d_native._resolve_process_group,
        "_C._distributed_c10d._unregister_process_group": lambda: c10d_native._unregister_process_group,
        "ProcessGroup._register_backend": lambda: dist.ProcessGroup._register_backend,
        "ProcessGroup._set_default_backend": lambda: dist.ProcessGroup._set_default_backend,
        "ProcessGroup._get_backend": lambda: dist.ProcessGroup._get_backend,
        "ProcessGroup._device_types": lambda: dist.ProcessGroup._device_types,
        "ProcessGroup._set_group_name": lambda: dist.ProcessGroup._set_group_name,
        "ProcessGroup._set_group_desc": lambda: dist.ProcessGroup._set_group_desc,
        "Work._source_rank": lambda: dist.Work._source_rank,
        "ProcessGroup._start_coalescing": lambda: dist.ProcessGroup._start_coalescing,
        "ProcessGroup._end_coalescing": lambda: dist.ProcessGroup._end_coalescing,
        # Names torch calls on a ProcessGroup written in Python (labkit.rank.instruments.timed_group overrides them).
        "ProcessGroup._allgather_base": lambda: dist.ProcessGroup._allgather_base,
        "ProcessGroup._reduce_scatter_base": lambda: dist.ProcessGroup._reduce_scatter_base,
        "cuda._sleep": lambda: torch.cuda._sleep,
        "autograd.Variable._execution_engine.queue_callback":
            lambda: torch.autograd.Variable._execution_engine.queue_callback,
        "distributed.tensor._utils.compute_local_shape_and_global_offset":
            lambda: import_module("torch.distributed.tensor._utils").compute_local_shape_and_global_offset,
    }
    missing = []
    for name, look_up in checks.items():
        try:
            look_up()
        except AttributeError:
            missing.append(name)
    return missing


def _world_table(table: str) -> Callable[[], object]:
    """A look-up of one table of torch's registry, made when called (``missing_internals``)."""
    return lambda: getattr(c10d._world, table)


# -- the registry of process groups --------------------------------------------------


def all_process_groups() -> list:
    """Every process group this process has made (the default one and each ``new_group``)."""
    return list(c10d._world.pg_map)


def default_group():
    """The default (world) group as torch holds it, stand-in or not; None before init."""
    return c10d._world.default_pg


def set_default_group(group) -> None:
    """Make ``group`` what torch's collectives use when given no group."""
    c10d._update_default_pg(group)


def group_name(name: str) -> GroupName:
    """``name`` as torch types a group's name (a plain str at run time)."""
    return cast("GroupName", name)


def group_by_name(name: str):
    """The group registered under ``name`` (how functional collectives and DTensor find one)."""
    return c10d_native._resolve_process_group(group_name(name))


def take_place_of(inner, stand_in, by_name: bool = True) -> None:
    """Register ``stand_in`` as ``inner`` is registered: same ranks, same store, same name and description.

    ``by_name=False`` leaves the lookup by name with whatever holds the name now."""
    world = c10d._world
    for table in _WORLD_TABLES:
        getattr(world, table)[stand_in] = getattr(world, table)[inner]
    if inner in world.pg_backend_config:
        world.pg_backend_config[stand_in] = world.pg_backend_config[inner]
    if inner in world.pg_to_tag:
        tag = world.pg_to_tag[inner]
        world.pg_to_tag[stand_in] = tag
        world.tags_to_pg.setdefault(tag, []).append(stand_in)
    stand_in._set_group_name(inner.group_name)
    stand_in._set_group_desc(inner.group_desc)
    if by_name:
        c10d_native._unregister_process_group(inner.group_name)
        c10d_native._register_process_group(inner.group_name, stand_in)


def new_backend_group(group_size: int, group_rank: int, global_ranks: list[int], backend: str, store,
                      name: str, options=None, timeout: timedelta | None = None, device_id=None,
                      description: str = "undefined"):
    """A process group built by torch exactly as ``new_group`` would build it, but unknown to its registry.

    The lab's stable groups (``rank.lab_groups``) put their own handle in the registry and hold this one
    inside: a rebuild replaces it without the registry (or anything a user built) noticing. ``store``
    should be unique to the generation: the group's rendezvous keys are ``name`` under it."""
    group, _ = c10d._new_process_group_helper(group_size, group_rank, global_ranks, backend, store, group_name(name),
                                              backend_options=options, timeout=timeout, device_id=device_id,
                                              group_desc=description)
    forget_registration(group)
    return group


def hand_over_registration(group, stand_in) -> None:
    """``stand_in`` takes ``group``'s place in torch's registry (name, ranks, store) and ``group`` leaves it,
    working still: only ``stand_in`` is shut down when the world is destroyed."""
    name = group.group_name
    take_place_of(group, stand_in)
    forget_registration(group)  # also drops the name, which stand_in holds now: registered again below
    c10d_native._register_process_group(name, stand_in)


def is_registered(group) -> bool:
    """Whether torch's registry holds ``group`` (destroying the world then shuts it down)."""
    return group in c10d._world.pg_names


def forget_registration(group) -> None:
    """Remove ``group`` from torch's registry of groups (tables and lookup by name), leaving it working."""
    world = c10d._world
    name = world.pg_names.get(group)
    for table in (*_WORLD_TABLES, "pg_backend_config", "pg_coalesce_state"):
        getattr(world, table).pop(group, None)
    world.pg_to_tag.pop(group, None)
    for tagged in world.tags_to_pg.values():
        if group in tagged:
            tagged.remove(group)
    if name is not None:
        with contextlib.suppress(Exception):  # registered under another name, or not at all
            c10d_native._unregister_process_group(name)


def register_group(group, name: str, backend: str, store, backend_config: str, rank_mapping: dict) -> None:
    """Put ``group`` in torch's registry as ``new_group`` would: by name, with its ranks and store."""
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(group, backend_name=backend, store=store, group_name=name, backend_config=backend_config,
                 rank_mapping=rank_mapping, add_to_default_tag=True)
        return
    # torch before 2.12 fills the same tables inline where it makes a group.
    world = c10d._world
    world.pg_map[group] = (backend, store)
    world.pg_names[group] = group_name(name)
    world.pg_backend_config[group] = backend_config
    world.pg_group_ranks[group] = rank_mapping
    c10d_native._register_process_group(group_name(name), group)
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault("", []).append(group)
    world.tags_to_pg.setdefault(tag, []).append(group)
    world.pg_to_tag[group] = tag


def routes_new_groups() -> bool:
    """Whether torch's ``new_group`` asks a default group written in Python to make the group (torch 2.12
    on): then every group a cell or a mesh makes is one of the lab's handles (``rank.lab_groups``)."""
    return "new_group" in c10d._new_group_with_tag.__code__.co_names


def share_bound_device(stand_in, group) -> None:
    """``stand_in`` is bound to ``group``'s device, as the backends it takes over are: registering a
    backend on a group binds the backend to the group's device, None unless set first."""
    stand_in.bound_device_id = group.bound_device_id


def install_world(group, backend: str, store) -> None:
    """Make ``group`` torch's default (world) group, registered as ``init_process_group`` registers it.

    Its name is a number, as torch's are; the groups made after it are numbered from there on every rank."""
    backend_config = str(c10d.BackendConfig(dist.Backend(backend)))
    register_group(group, group.group_name, backend, store, backend_config, {i: i for i in range(group.size())})
    c10d._update_default_pg(group)
    c10d._world.group_count = int(group.group_name) + 1


def set_world_store(group, store) -> None:
    """The store new groups rendezvous on (``new_group`` takes the default group's)."""
    backend, _ = c10d._world.pg_map[group]
    c10d._world.pg_map[group] = (backend, store)


def clear_registry() -> None:
    """Forget every group without shutting any down (their handles were retired: ``rank.lab_groups``).

    Each stays known by its ranks and backend (not by name, so new groups may take the names): torch
    looks those up before it calls a group, and the group's own error is the one to see."""
    world = c10d._world
    kept = {table: dict(getattr(world, table)) for table in ("pg_map", "pg_group_ranks", "pg_backend_config")}
    c10d._update_default_pg(None)
    for table in (*_WORLD_TABLES, "pg_backend_config", "pg_to_tag", "tags_to_pg", "pg_coalesce_state"):
        getattr(world, table).clear()
    for table, entries in kept.items():
        getattr(world, table).update(entries)
    c10d._unregister_all_process_groups()
    world.group_count = 0


def group_lifecycle() -> tuple:
    """torch's ``init_process_group`` and ``destroy_process_group`` as its own code calls them."""
    return c10d.init_process_group, c10d.destroy_process_group


@contextlib.contextmanager
def group_lifecycle_replaced(init, destroy):
    """While inside: ``init_process_group``/``destroy_process_group`` are ``init`` and ``destroy``, both as
    ``torch.distributed`` offers them and as ``distributed_c10d`` holds them (what torch's helpers call)."""
    original = group_lifecycle()
    modules = (dist, c10d)
    for module in modules:
        module.init_process_group, module.destroy_process_group = init, destroy
    try:
        yield
    finally:
        for module in modules:
            module.init_process_group, module.destroy_process_group = original


def set_group_timeout(group, limit: timedelta, nccl_limit: timedelta | None = None) -> None:
    """Bound the collectives of ``group``'s backends by ``limit``, its nccl backend by ``nccl_limit`` when
    given (raises for backends without the knob)."""
    for device in device_types(group):
        backend = backend_of(group, device)
        backend._set_default_timeout(nccl_limit if nccl_limit is not None and backend.name() == "nccl" else limit)


def abort_process_groups() -> None:
    """Abort every group of this process (nccl: its communicators), so peers waiting on it fail now."""
    c10d._abort_process_group()


# -- one process group's backends ------------------------------------------------------


def device_types(group) -> list:
    """The device types a group has a backend for (``cpu:gloo,cuda:nccl`` has two)."""
    return list(group._device_types)


def backend_of(group, device):
    """The backend ``group`` uses for tensors on ``device`` (a torch.device or its type)."""
    return group._get_backend(device)


def register_backend(group, device, backend_type, backend) -> None:
    group._register_backend(device, backend_type, backend)


def set_default_backend(group, backend_type) -> None:
    group._set_default_backend(backend_type)


def backend_timeout(group, device) -> timedelta | None:
    """The time limit of ``group``'s backend for ``device``; None when the backend does not say."""
    try:
        return backend_of(group, device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def coalesces_p2p(group, device) -> bool:
    """Whether ``group`` posts sends and receives on ``device`` as one group when asked (nccl's do).

    A group written in Python says so itself (a ``supports_coalescing`` attribute), as a backend does."""
    if type(group) is not dist.ProcessGroup:
        return bool(getattr(group, "supports_coalescing", False))
    try:
        return bool(backend_of(group, torch.device(device)).supports_coalescing)
    except (AttributeError, RuntimeError):  # no backend for that device
        return False


def start_coalescing(group, device) -> None:
    """What torch's ``batch_isend_irecv`` does first on nccl: operations from now on go in one group."""
    group._start_coalescing(torch.device(device))


def end_coalescing(group, device):
    """Post the operations since ``start_coalescing`` as one group; the group's work."""
    return group._end_coalescing(torch.device(device))


def work_source_rank(work) -> int:
    """Who sent what a receive from any source got (torch's ``recv`` asks the work)."""
    return work._source_rank()


# -- meshes and DTensor -------------------------------------------------------------------


def mesh_group_names(mesh) -> list[str]:
    """The registered names of a DeviceMesh's groups, one per dimension."""
    return list(mesh._dim_group_names)


def put_in_mesh(mesh, name: str, group) -> None:
    """Where a DeviceMesh keeps its own table of groups by name, make ``name`` resolve to ``group``."""
    registry = getattr(mesh, "_pg_registry", None)
    if registry is not None and name in registry:
        registry[name] = group


def local_slices(shape: torch.Size, tensor) -> tuple[slice, ...]:
    """Where DTensor ``tensor``'s local shard lies in a whole tensor of ``shape`` (what this rank keeps of it)."""
    local = import_module("torch.distributed.tensor._utils").compute_local_shape_and_global_offset
    sizes, offsets = local(shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(offset, offset + size) for size, offset in zip(sizes, offsets))


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding plans (in C++ and in Python) and torch's stack of current meshes.

    Both are keyed without the process groups they were made on; after a rebuild they would name
    destroyed or different groups. A process that never used DTensor has nothing cached."""
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    # A module never imported cached nothing; importing DTensor only to clear it would cost ~0.8 s
    # of CPU per rank, on the critical path of every lab's start.
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        for cached in (getattr(propagator, "propagate_op_sharding", None),
                       getattr(propagator, "_propagate_tensor_meta_cached", None)):
            for clear in (getattr(cached, "cache_clear", None),
                          getattr(getattr(cached, "cache", None), "cache_clear", None)):
                if clear is not None:
                    clear()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import _mesh_resources

        if hasattr(_mesh_resources, "mesh_stack"):
            _mesh_resources.mesh_stack.clear()


# -- CUDA -----------------------------------------------------------------------------------


def spin_gpu(cycles: int) -> None:
    """Enqueue a kernel on the current stream that spins for ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)


# -- autograd ---------------------------------------------------------------------------


def at_end_of_backward(callback) -> None:
    """Run ``callback`` when the current backward pass finishes (called from inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)

