"""Process groups that time every collective, whoever calls it.

A ``TimedGroup`` is a ``torch.distributed.ProcessGroup`` written in Python that
stands in front of a real gloo (or nccl) group: every collective it is asked for
is passed to the real group unchanged, and the call is noted (kind, bytes, when
it was issued) together with when its work completed. Because it *is* the
process group, it sees DDP's bucketed all-reduces issued from C++ during
backward, FSDP's all-gathers and reduce-scatters, DTensor's functional
collectives (resolved by group name) and the pipeline's sends and receives.

``instrument_mesh`` swaps the groups of a ``DeviceMesh`` for timed ones under the
same names, so everything built on the mesh afterwards is measured. Operations a
TimedGroup does not override still work: the base class sends them to the real
group's backend, untimed.

On a GPU the times are CUDA events (see ``gpu_instruments``): the CPU only
enqueues the work, so only the device's clock says when it ran.

Bytes follow nccl-tests: the buffer an operation works on (the gathered output
for all-gather, the full input for reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.rank import torch_internals


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


def _device_type(value) -> str:
    """'cuda' when the operation's tensors live on a GPU, else 'cpu'."""
    if isinstance(value, torch.Tensor):
        return value.device.type
    if isinstance(value, (list, tuple)) and value:
        return _device_type(value[0])
    return "cpu"


class TimedWork(dist.Work):
    """Wraps a real work handle so its ``wait`` is seen by the recorder.

    Send and receive have no future: their completion is noted when ``wait``
    returns. On a GPU every work is wrapped, so that a wait of the compute
    stream (``wait`` on CUDA makes the current stream wait) is bracketed.
    """

    def __init__(self, inner: dist.Work, recorder, on_done=None) -> None:
        super().__init__()
        self.inner = inner
        self.recorder = recorder
        self.on_done = on_done

    def wait(self, timeout=None) -> bool:
        with self.recorder.waiting():
            result = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        if self.on_done is not None:
            self.on_done()
        return result

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_success(self) -> bool:
        return self.inner.is_success()

    def exception(self):
        return self.inner.exception()

    def get_future(self):
        return self.inner.get_future()

    def result(self):
        return self.inner.result()

    def _source_rank(self) -> int:  # a receive from any source: who sent (torch's recv asks the work)
        return torch_internals.work_source_rank(self.inner)


class TimedGroup(dist.ProcessGroup):
    """A process group that forwards every collective to ``inner`` and reports it to ``recorder``.

    For each operation: ``token = recorder.issued(device_type)`` when it is
    issued, ``recorder.completed(kind, nbytes, token)`` when it completes (from
    the work's completion callback, or after ``wait`` for send/recv); waits go
    through ``recorder.waiting()``. ``instruments.StepRecorder`` keeps CPU
    times, ``gpu_instruments.CudaStepRecorder`` CUDA events. ``link``, the
    rank's ``slow_link.LinkState``, may complete works later, as a slow network would.
    """

    def __init__(self, inner: dist.ProcessGroup, recorder, link=None) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.recorder = recorder
        self.link = link
        # A group may have one backend per device type ("cpu:gloo,cuda:nccl"):
        # register each under its own type, and make the GPU's the default.
        default = None
        for device in torch_internals.device_types(inner):
            backend = torch_internals.backend_of(inner, device)
            torch_internals.register_backend(self, device, _backend_type(backend), backend)
            if default is None or device.type == "cuda":
                default = _backend_type(backend)
        torch_internals.set_default_backend(self, default if default is not None else _backend_type(inner))

    # -- bookkeeping ------------------------------------------------------

    def _issue(self, kind: str, nbytes: int, call, tensors, *args, **kwargs):
        recorder = self.recorder
        token = recorder.issued(_device_type(tensors))
        work = call(tensors, *args, **kwargs)
        if self.link is not None:  # a simulated slow link: the work completes when the link has carried it
            slowed = self.link.slow(work, kind, nbytes, self.size(), recorder, token, tensors)
            if slowed is not None:
                return slowed
        try:
            future = work.get_future()
        except RuntimeError:  # p2p work has no future: its wait() marks completion
            return TimedWork(work, recorder, lambda: recorder.completed(kind, nbytes, token))
        future.then(lambda _: recorder.completed(kind, nbytes, token))
        return TimedWork(work, recorder) if recorder.watches_waits else work

    # -- collectives --------------------------------------------------------

    def allreduce(self, tensors, *args, **kwargs):
        return self._issue("all_reduce", _bytes(tensors), self.inner.allreduce, tensors, *args, **kwargs)

    def allreduce_coalesced(self, tensors, *args, **kwargs):
        return self._issue("all_reduce", _bytes(tensors), self.inner.allreduce_coalesced, tensors, *args, **kwargs)

    def allgather(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("all_gather", _bytes(output_tensors), self.inner.allgather, output_tensors, input_tensors, *args, **kwargs)

    def _allgather_base(self, output, input, *args, **kwargs):
        return self._issue("all_gather", _bytes(output), self.inner._allgather_base, output, input, *args, **kwargs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("all_gather", _bytes(outputs), self.inner.allgather_into_tensor_coalesced, outputs, inputs, *args, **kwargs)

    def reduce_scatter(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input_tensors), self.inner.reduce_scatter, output_tensors, input_tensors, *args, **kwargs)

    def _reduce_scatter_base(self, output, input, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input), self.inner._reduce_scatter_base, output, input, *args, **kwargs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(inputs), self.inner.reduce_scatter_tensor_coalesced, outputs, inputs, *args, **kwargs)

    def all_gather_single(self, output, input, *args, **kwargs):
        return self._issue("all_gather", _bytes(output), self.inner.all_gather_single, output, input, *args, **kwargs)

    def all_gather_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("all_gather", _bytes(outputs), self.inner.all_gather_single_coalesced, outputs, inputs, *args, **kwargs)

    def reduce_scatter_single(self, output, input, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input), self.inner.reduce_scatter_single, output, input, *args, **kwargs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(inputs), self.inner.reduce_scatter_single_coalesced, outputs, inputs, *args, **kwargs)

    def all_to_all_single(self, output, input, *args, **kwargs):
        return self._issue("all_to_all", _bytes(input), self.inner.all_to_all_single, output, input, *args, **kwargs)

    def broadcast(self, tensors, *args, **kwargs):
        return self._issue("broadcast", _bytes(tensors), self.inner.broadcast, tensors, *args, **kwargs)

    def alltoall_base(self, output, input, *args, **kwargs):
        return self._issue("all_to_all", _bytes(input), self.inner.alltoall_base, output, input, *args, **kwargs)

    def send(self, tensors, *args, **kwargs):
        return self._issue("send", _bytes(tensors), self.inner.send, tensors, *args, **kwargs)

    def recv(self, tensors, *args, **kwargs):
        return self._issue("recv", _bytes(tensors), self.inner.recv, tensors, *args, **kwargs)

    def recv_anysource(self, tensors, *args, **kwargs):
        return self._issue("recv", _bytes(tensors), self.inner.recv_anysource, tensors, *args, **kwargs)

    def barrier(self, *args, **kwargs):
        return self._issue("barrier", 0, lambda _: self.inner.barrier(*args, **kwargs), None)

    # -- identity -------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - the name pybind calls
        return self.inner.name()

    def name(self) -> str:
        return self.inner.name()


def _backend_type(group):
    """The BackendType of a process group or of one of its per-device backends."""
    name = group.name()
    return {"gloo": dist.ProcessGroup.BackendType.GLOO, "nccl": dist.ProcessGroup.BackendType.NCCL}.get(
        name, dist.ProcessGroup.BackendType.CUSTOM
    )


def wrap_group(inner: dist.ProcessGroup, recorder, link=None, by_name: bool = True) -> TimedGroup:
    """Put a TimedGroup in ``inner``'s place: same name, same ranks, same store.

    ``by_name=False`` leaves lookups by name (functional collectives) with whatever holds the name."""
    timed = TimedGroup(inner, recorder, link)
    torch_internals.take_place_of(inner, timed, by_name=by_name)
    return timed


def instrument_mesh(mesh, recorder, link=None) -> None:
    """Make every collective over ``mesh``'s groups reach ``recorder`` (and cross ``link``)."""
    for name in torch_internals.mesh_group_names(mesh):
        group = torch_internals.group_by_name(name)
        if not isinstance(group, TimedGroup):
            torch_internals.put_in_mesh(mesh, name, wrap_group(group, recorder, link))
        elif getattr(group.recorder, "quiet", False):
            # Only slowed so far (slow_link, a run without instruments); meshes share the world group's name.
            group.recorder = recorder
