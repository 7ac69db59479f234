"""This rank's process groups as handles that outlive a rebuild: what user objects hold stays valid.

Runs in the engines. A DDP module, an FSDP2 model, a DTensor and a DeviceMesh
each keep the process group they were built on. When a collective is cut (a
peer raised or was interrupted while the others waited in it), gloo's
connections of that group are useless, and a group rebuilt by
``init_process_group`` would be a different object: everything built before
would fail with errors that name no cause. So every group of a rank is a
handle (``timed_group.TimedGroup``) holding the real group inside:

- ``form`` makes the world (the default group) a handle, at the lab's start
  and whenever the ranks change (one was replaced, the world grew or shrank):
  the handles of before are retired then, and fail at once with the reason;
- torch asks the default group for every new group (``new_group``, a
  DeviceMesh's groups: ``WorldGroup.new_group``), so those are handles too,
  registered under torch's names;
- ``reconfigure`` gives every live handle the same ranks' group of a new
  generation, built as torch builds it, on rendezvous keys of that
  generation; the handles, their names and their ranks do not change, so the
  objects built on them go on;
- ``release`` closes the connections of this rank's groups, so peers waiting
  in a collective that cannot complete fail now instead of at the time limit.

Every rank creates its groups in the same order (torch requires it), so
rebuilding them in creation order never has two ranks wait for each other in
different groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from labkit.rank.group_memory import forget_old_groups
from labkit.rank.instruments.slow_link import QuietRecorder
from labkit.rank.instruments.timed_group import TimedGroup
from labkit.rank.release import close_connections, established_connections
from labkit.torch_support import torch_internals

GROUPS_PER_FORMATION = 1000  # names of a formation's groups: a stale mesh must not find a new group by name


def world_name(generation: int) -> str:
    """The default group's name when it is formed in ``generation``: torch's "0" at the lab's start,
    and past every name used before afterwards (DTensor and meshes find groups by name)."""
    return "0" if generation <= 1 else str(generation * GROUPS_PER_FORMATION)


@dataclass(frozen=True)
class GroupRecipe:
    """How a group was made, to make it again in a new generation."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in the group's order
    description: str
    options: object = None  # torch's backend options (nccl), as new_group was given them
    timeout: timedelta | None = None  # None: the lab's


class WorldGroup(TimedGroup):
    """The default group's handle; torch asks it for every new group (``_new_group_with_tag``)."""

    def __init__(self, inner, recorder, link, family: "LabGroups") -> None:
        super().__init__(inner, recorder, link)
        self.family = family

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):
        return self.family.new_group(list(ranks), timeout, pg_options, group_name, group_desc)


class LabGroups:
    """The handles of one rank's groups, the generation they are of, and the connections under them."""

    def __init__(self, backend: str, device_id=None, link=None, keep_ports=frozenset()) -> None:
        """``backend``: what ``init_process_group`` would be given ('gloo', 'cpu:gloo,cuda:nccl');
        ``device_id``: the GPU an nccl world binds eagerly; ``link``: the rank's ``slow_link.LinkState``;
        ``keep_ports``: the ipyparallel controller's ports, whose connections are never the groups'."""
        self.keep_ports = frozenset(keep_ports)
        self.backend = backend
        self.device_id = device_id
        self.link = link
        self.world: WorldGroup | None = None
        self.handles: dict[TimedGroup, GroupRecipe] = {}  # live handles, in creation order (the world first)
        self.store: dist.TCPStore | None = None  # the rendezvous store of the world formed last
        self.generation = 0
        self.timeout: timedelta | None = None
        self.connections: set = set()  # (local, remote) addresses of the TCP connections of this rank's groups
        self.new_recorder = None  # what a group made now reports to (None: nothing; see ``recording_into``)

    # -- building ---------------------------------------------------------------

    def _world_store(self) -> dist.TCPStore:
        assert self.store is not None  # form() came first
        return self.store

    def _world(self) -> WorldGroup:
        assert self.world is not None  # form() made the world before any other group
        return self.world

    def _generation_store(self):
        return dist.PrefixStore(f"labkit/g{self.generation}/", self._world_store())

    def _build(self, recipe: GroupRecipe, world: bool = False):
        """The real group of ``recipe`` for this generation (rendezvous with its other members)."""
        rank = self._world().rank() if not world else self._rank
        before = established_connections()
        raw = torch_internals.new_backend_group(
            len(recipe.ranks), recipe.ranks.index(rank), [] if world else list(recipe.ranks), self.backend,
            self._generation_store(), f"{recipe.name}@{self.generation}", options=recipe.options,
            timeout=recipe.timeout or self.timeout, device_id=self.device_id if world else None,
            description=recipe.description)
        # Only gloo's: the store's connections (a rank whose store client connected while rank 0 built
        # its group shows up here on rank 0) and the controller's must never be closed.
        kept = {self._world_store().port, *self.keep_ports}
        self.connections |= {pair for pair in established_connections() - before
                             if pair[0][1] not in kept and pair[1][1] not in kept}
        return raw

    def form(self, store, generation: int, rank: int, world_size: int, timeout) -> WorldGroup:
        """A new world of ``world_size`` ranks on ``store``, after ``retire`` retired the handles of before."""
        self.store, self.generation, self.timeout, self._rank = store, generation, timeout, rank
        recipe = GroupRecipe(world_name(generation), tuple(range(world_size)), "default_pg")
        world = WorldGroup(self._build(recipe, world=True), QuietRecorder(), self.link, self)
        world._set_group_name(torch_internals.group_name(recipe.name))
        world._set_group_desc("default_pg")
        torch_internals.install_world(world, self.backend, self._generation_store())
        self.world = world
        self.handles = {world: recipe}
        return world

    def new_group(self, ranks: list[int], timeout, options, name: str, description: str | None):
        """A handle for the group of ``ranks`` that torch is making as ``name`` (None on other ranks)."""
        if self._world().rank() not in ranks:
            return None
        recipe = GroupRecipe(str(name), tuple(ranks), description or "undefined", options, timeout)
        handle = TimedGroup(self._build(recipe), self.new_recorder or QuietRecorder(), self.link)
        handle._set_group_name(torch_internals.group_name(recipe.name))
        handle._set_group_desc(recipe.description)
        self.handles[handle] = recipe
        return handle

    def adopt_mesh(self, mesh) -> None:
        """Make handles of the groups ``mesh`` got straight from torch (a torch that does not ask the
        default group for new groups, before 2.12), so a rebuild in place remakes them too."""
        for name in torch_internals.mesh_group_names(mesh):
            raw = torch_internals.group_by_name(name)
            if isinstance(raw, TimedGroup) or raw is None:
                continue
            recipe = GroupRecipe(name, tuple(dist.get_process_group_ranks(raw)), raw.group_desc)
            handle = TimedGroup(raw, QuietRecorder(), self.link)
            torch_internals.hand_over_registration(raw, handle)
            torch_internals.put_in_mesh(mesh, name, handle)
            self.handles[handle] = recipe

    @contextlib.contextmanager
    def recording_into(self, recorder):
        """Within: the groups that note nothing (the world, a cell's or script's own) report every operation
        to ``recorder``, and so do groups made meanwhile; afterwards they note nothing again. A loop the lab
        did not write is watched so (``instruments.loop_watch``); the meshes of ``lab.train`` record already."""
        before = set(self.handles)
        quiet = {handle for handle in before if getattr(handle.recorder, "quiet", False)}
        for handle in quiet:
            handle.recorder = recorder
        self.new_recorder = recorder
        try:
            yield
        finally:
            self.new_recorder = None
            for handle in self.handles:
                if handle in quiet or (handle not in before and handle.recorder is recorder):
                    handle.recorder = QuietRecorder()

    def reconfigure(self, generation: int, timeout) -> int:
        """Every live handle gets its group of generation ``generation`` (same ranks, same names); how many.

        Every rank has released its old connections first (``Session.rebuild_group``): a rank closing them
        while its peers connect anew would break the new groups."""
        self.connections = set()
        self.generation, self.timeout = generation, timeout
        self.handles = {handle: recipe for handle, recipe in self.handles.items() if handle.stale is None}
        for handle, recipe in self.handles.items():
            handle.replace_inner(self._build(recipe, world=handle is self.world))
        torch_internals.set_world_store(self.world, self._generation_store())
        return len(self.handles)

    # -- ending -------------------------------------------------------------------

    def release(self) -> int:
        """Close this rank's group connections (nccl: abort its communicators); peers waiting fail now."""
        if "nccl" in self.backend:
            for handle in self.handles:
                if handle.inner is not None:
                    try:
                        handle.inner.abort()
                    except Exception:  # noqa: BLE001 - already torn down: nothing waits on it
                        pass
        return close_connections(self.connections)

    def retire(self, reason: str) -> None:
        """Every handle fails from now on with ``reason``; torch forgets them all."""
        self.release()
        for handle in self.handles:
            handle.retire(reason)
        self.handles = {}
        self.world = None
        self.connections = set()
        if dist.is_initialized():
            torch_internals.clear_registry()
        forget_old_groups()

    # -- what the notebook reads --------------------------------------------------------

    def state(self) -> dict:
        """Per live group: its ranks, operations issued, collectives, what is in flight and waited for."""
        return {recipe.name: {"ranks": list(recipe.ranks), "issued": handle.issued,
                              "collectives": handle.collectives,
                              "in_flight": [list(item) for item in handle.pending()],
                              "waiting": handle.waiting, "entering": handle.entering}
                for handle, recipe in list(self.handles.items()) if handle.stale is None}
