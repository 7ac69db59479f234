"""A gloo process group that answers as nccl does, so the GPU path's group handling runs on a CPU.

Since torch 2.8, nccl runs a collective asked with ``async_op=False`` on the
caller's current stream and gives no ``Work`` back (Python sees ``None``); it
coalesces sends and receives posted between ``_start_coalescing`` and
``_end_coalescing`` into one group, and a send posted alone can block its peer.
``NcclLikeGroup`` wraps a real gloo group: a synchronous collective is waited
for inside the call and answers ``None``; it says it coalesces, and counts the
sends and receives it was given alone and in a group; it counts its shutdowns.

``install(torch_internals)`` makes every group the lab builds from then on one
of these (rank side, for tests): the lab's handles then hold them as inner groups.
"""

from __future__ import annotations

import torch.distributed as dist


class _AllOf(dist.Work):
    """The work of a coalesced group: done when every operation in it is.

    Waited for by every operation of the group, so more than once: as nccl's work, a second wait
    returns at once (a gloo send's own wait would wait for another send)."""

    def __init__(self, works) -> None:
        super().__init__()
        self.works = works
        self._waited = False

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            for work in self.works:
                work.wait()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self.works)

    def get_future(self):
        raise RuntimeError("a coalesced send/receive group has no future here")


class NcclLikeGroup(dist.ProcessGroup):
    """``inner`` (a gloo group) answering as a synchronous-collective, coalescing nccl group."""

    supports_coalescing = True

    def __init__(self, inner: dist.ProcessGroup) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.shutdowns = 0
        self.answered_none = 0  # synchronous collectives answered with no work
        self.p2p_alone = 0  # sends and receives posted outside a coalesced group
        self.p2p_grouped = 0
        self._coalescing: list | None = None
        self.bound_device_id = inner.bound_device_id
        for device in inner._device_types:
            self._register_backend(device, dist.ProcessGroup.BackendType.GLOO, inner._get_backend(device))
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)

    def name(self) -> str:
        return self.inner.name()

    def getBackendName(self) -> str:  # noqa: N802 - the name pybind calls
        return self.inner.name()

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.inner.shutdown()

    def abort(self) -> None:
        self.inner.abort()

    # -- sends and receives ------------------------------------------------------

    def _point_to_point(self, name: str, *args):
        if self._coalescing is not None:
            self._coalescing.append((name, args))
            return None
        self.p2p_alone += 1
        return getattr(self.inner, name)(*args)

    def send(self, *args):
        return self._point_to_point("send", *args)

    def recv(self, *args):
        return self._point_to_point("recv", *args)

    def recv_anysource(self, *args):
        return self._point_to_point("recv_anysource", *args)

    def _start_coalescing(self, device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device):
        kept, self._coalescing = self._coalescing or [], None
        self.p2p_grouped += len(kept)
        return _AllOf([getattr(self.inner, name)(*args) for name, args in kept])


def _answers_as_nccl(name: str):
    def operation(self, *args):
        work = getattr(self.inner, name)(*args)
        options = next((arg for arg in args if hasattr(arg, "asyncOp")), None)
        if options is not None and not options.asyncOp:
            work.wait()  # nccl would have enqueued it on the current stream: done in stream order
            self.answered_none += 1
            return None
        return work

    operation.__name__ = name
    return operation


for _name in ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
              "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
              "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall",
              "alltoall_base", "barrier"):
    setattr(NcclLikeGroup, _name, _answers_as_nccl(_name))


def install(torch_internals) -> None:
    """From now on every group the lab builds on this rank is wrapped in a ``NcclLikeGroup``."""
    build = torch_internals.new_backend_group
    if getattr(build, "nccl_like", False):
        return

    def nccl_like(*args, **kwargs):
        return NcclLikeGroup(build(*args, **kwargs))

    nccl_like.nccl_like = True
    torch_internals.new_backend_group = nccl_like


def counts(groups) -> dict:
    """What the rank's NcclLikeGroups saw, summed (``groups``: the rank's LabGroups)."""
    total = {"answered_none": 0, "p2p_alone": 0, "p2p_grouped": 0, "groups": 0}
    for handle in groups.handles:
        inner = handle.inner
        if isinstance(inner, NcclLikeGroup):
            total["groups"] += 1
            for key in ("answered_none", "p2p_alone", "p2p_grouped"):
                total[key] += getattr(inner, key)
    return total

