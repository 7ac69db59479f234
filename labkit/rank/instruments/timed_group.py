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

import contextlib
import time

import torch
import torch.distributed as dist

from labkit.rank.instruments.p2p_batch import P2PBatch
from labkit.rank.instruments.timed_work import TimedWork
from labkit.torch_support import torch_internals


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


class StaleGroupError(RuntimeError):
    """A process group that can no longer be used (its ranks changed, or it was destroyed); says why."""


class TimedGroup(dist.ProcessGroup):
    """A process group that forwards every operation to ``inner`` and reports it to ``recorder``.

    For each operation: ``token = recorder.issued(device_type, kind, nbytes)`` when it is
    issued, ``recorder.completed(kind, nbytes, token)`` when it completes (from
    the work's completion callback, or after ``wait`` for send/recv); waits go
    through ``recorder.waiting()``. ``instruments.StepRecorder`` keeps CPU
    times, ``gpu_instruments.CudaStepRecorder`` CUDA events. ``link``, the
    rank's ``slow_link.LinkState``, may complete works later, as a slow network would.

    It is also the handle user code holds (``rank.lab_groups``): ``inner`` can be
    replaced by the same group of a new generation (``replace_inner``), and a group
    that cannot come back is ``retire``d, after which every operation raises
    ``StaleGroupError`` with the reason. It counts what it issued (``issued``, the
    sequence number of the latest operation), keeps what has not completed
    (``pending()``: sequence, kind, bytes, when) and which operation a thread
    waits for (``waiting``): how the notebook tells an intact group from a cut one.
    """

    def __init__(self, inner: dist.ProcessGroup, recorder, link=None) -> None:
        # torch's stubs list only (store, rank, size); the binding also takes (rank, size), as here.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.inner: dist.ProcessGroup | None = inner  # None once retired or shut down
        self.recorder = recorder
        self.link = link
        self.issued = 0
        self.collectives = 0  # operations every member takes part in (not send/recv): equal on all members
        self.in_flight: dict[int, tuple] = {}  # sequence -> (kind, bytes, issued at, work)
        self.waiting: int | None = None
        self.entering: int | None = None  # the operation whose call has not answered yet
        self.stale: str | None = None
        self._p2p_batch: P2PBatch | None = None
        self._backend_name = inner.name()
        torch_internals.share_bound_device(self, inner)  # before the backends: registering one binds it
        # A group may have one backend per device type ("cpu:gloo,cuda:nccl"):
        # register each under its own type, and make the GPU's the default. Torch's collective checker
        # (check_collectives) registers the backend it checks: torch's C++ casts a gloo backend to gloo
        # (DDP's constructor; a checker there crashed every rank). Operations go through ``inner``, checked.
        default = None
        for device in torch_internals.device_types(inner):
            backend = torch_internals.backend_of(inner, device)
            backend = getattr(backend, "wrapped_pg", backend)
            torch_internals.register_backend(self, device, _backend_type(backend), backend)
            if default is None or device.type == "cuda":
                default = _backend_type(backend)
        torch_internals.set_default_backend(self, default if default is not None else _backend_type(inner))

    # -- the handle's life --------------------------------------------------

    def replace_inner(self, inner: dist.ProcessGroup) -> None:
        """Go on with ``inner``, the same ranks' group of a new generation; counting starts again."""
        self.inner = inner
        self.issued = self.collectives = 0
        self.in_flight = {}
        self.waiting = self.entering = None
        self._p2p_batch = None

    def retire(self, reason: str) -> None:
        """Every later operation raises ``StaleGroupError(reason)``."""
        self.stale = reason
        self.inner = None
        self.in_flight = {}
        self.waiting = self.entering = None
        self._p2p_batch = None

    def live(self) -> dist.ProcessGroup:
        if self.inner is None:
            raise StaleGroupError(self.stale or "this process group was destroyed")
        return self.inner

    def shutdown(self) -> None:  # destroy_process_group(group)
        inner, self.inner = self.inner, None
        self.stale = self.stale or f"process group {self.group_name!r} was destroyed (destroy_process_group)"
        # A stand-in (``wrap_group``) leaves its real group in torch's registry, and destroying the world
        # shuts down every registered group: shutting it down here as well would shut one nccl backend
        # down twice. Only a group torch does not know (a handle's, ``rank.lab_groups``) is ours to end.
        if inner is not None and not torch_internals.is_registered(inner):
            inner.shutdown()

    def abort(self) -> None:
        if self.inner is not None:
            self.inner.abort()

    # -- bookkeeping ------------------------------------------------------

    def _issue(self, kind: str, nbytes: int, call, tensors, *args, **kwargs):
        """``call``: the name of ``inner``'s method (given ``tensors, *args, **kwargs``), or ``f(inner, tensors)``."""
        inner = self.live()
        batch = self._p2p_batch
        if batch is not None:
            if kind in _POINT_TO_POINT:
                return batch.keep(kind, nbytes, call, tensors, args, kwargs)
            batch.post()  # what was kept goes first, in the order it was given
        token, sequence = self.begin_operation(kind, tensors, nbytes)
        # The call itself may block: torch's collective checker (check_collectives) first meets every member
        # on a group of its own, which a member that never calls the collective leaves waiting. Meanwhile the
        # operation is in flight and waited for, with no work yet, so the notebook can name who never came.
        self.in_flight[sequence] = (kind, nbytes, time.time(), None)
        self.entering = self.waiting = sequence
        try:
            work = getattr(inner, call)(tensors, *args, **kwargs) if isinstance(call, str) else call(inner, tensors)
        except BaseException:
            self.in_flight.pop(sequence, None)
            raise
        finally:
            self.entering = None
            if self.waiting == sequence:
                self.waiting = None
        return self.answer_for(kind, nbytes, token, sequence, work, tensors)

    def begin_operation(self, kind: str, tensors, nbytes: int = 0) -> tuple:
        """An operation is being issued: tell the recorder (what and how many bytes: they belong to the step
        that issues them), count it; (recorder's token, sequence number)."""
        token = self.recorder.issued(_device_type(tensors), kind, nbytes)
        self.issued += 1
        if kind not in _POINT_TO_POINT:
            self.collectives += 1
        if len(self.in_flight) > _IN_FLIGHT_PRUNE_AT:
            self.pending()
        return token, self.issued

    def answer_for(self, kind: str, nbytes: int, token, sequence: int, work, tensors):
        """What the caller gets for ``work``, the inner group's answer: completion reaches the recorder."""
        recorder = self.recorder
        if work is None:
            # nccl (torch 2.8 on) runs a synchronous collective on the caller's current stream and answers
            # no work: it is complete in stream order. torch's callers expect None back then.
            self.in_flight.pop(sequence, None)
            if self.link is not None:
                self.link.hold_stream(kind, nbytes, self.size(), tensors)
            recorder.ran_in_stream(kind, nbytes, token)
            return None
        in_flight = self.in_flight
        in_flight[sequence] = (kind, nbytes, time.time(), work)

        def done(_=None) -> None:
            in_flight.pop(sequence, None)
            recorder.completed(kind, nbytes, token)

        if self.link is not None:  # a simulated slow link: the work completes when the link has carried it
            slowed = self.link.slow(work, kind, nbytes, self.size(), recorder, token, tensors,
                                    on_done=lambda: in_flight.pop(sequence, None))
            if slowed is not None:
                return slowed
        try:
            future = work.get_future()
        except RuntimeError:  # p2p work has no future: its wait() marks completion
            return TimedWork(work, recorder, done, self, sequence)
        if not getattr(recorder, "quiet", False):
            # Measured: the recorder needs the moment it completed. A Python callback on the backend's
            # thread costs about a millisecond per collective on a busy machine, so unmeasured groups
            # learn completion from the wait, or by asking the work (``pending``).
            future.then(done)
        return TimedWork(work, recorder, None, self, sequence)

    @contextlib.contextmanager
    def p2p_batched(self, device):
        """Within: sends and receives on ``device`` are posted together, as one coalesced group, when a
        backend that coalesces carries them (nccl; see ``rank.instruments.p2p_batch``); elsewhere nothing changes."""
        if self._p2p_batch is not None or not torch_internals.coalesces_p2p(self.live(), device):
            yield
            return
        batch = self._p2p_batch = P2PBatch(self, device)
        try:
            yield
        except BaseException:
            # The step failed: what it had not posted stays unposted, as if it had raised before them.
            self._p2p_batch = None
            raise
        self._p2p_batch = None
        if self.inner is not None:  # not retired meanwhile
            batch.post()

    def pending(self) -> list[tuple[int, str, int, float]]:
        """(sequence, kind, bytes, issued at) of every operation not completed yet; forgets the completed."""
        in_flight = self.in_flight
        for sequence, (_, _, _, work) in list(in_flight.items()):
            if work is None:  # its call has not answered yet
                continue
            try:
                completed = work.is_completed()
            except Exception:  # noqa: BLE001 - a work of a cut group: it will never complete
                completed = False
            if completed:
                in_flight.pop(sequence, None)
        return [(sequence, kind, nbytes, since) for sequence, (kind, nbytes, since, _) in list(in_flight.items())]

    # -- collectives --------------------------------------------------------

    def allreduce(self, tensors, *args, **kwargs):
        return self._issue("all_reduce", _bytes(tensors), "allreduce", tensors, *args, **kwargs)

    def allreduce_coalesced(self, tensors, *args, **kwargs):
        return self._issue("all_reduce", _bytes(tensors), "allreduce_coalesced", tensors, *args, **kwargs)

    def allgather(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("all_gather", _bytes(output_tensors), "allgather", output_tensors, input_tensors, *args, **kwargs)

    def _allgather_base(self, output, input, *args, **kwargs):
        return self._issue("all_gather", _bytes(output), "_allgather_base", output, input, *args, **kwargs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("all_gather", _bytes(outputs), "allgather_into_tensor_coalesced", outputs, inputs, *args, **kwargs)

    def reduce_scatter(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input_tensors), "reduce_scatter", output_tensors, input_tensors, *args, **kwargs)

    def _reduce_scatter_base(self, output, input, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input), "_reduce_scatter_base", output, input, *args, **kwargs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(inputs), "reduce_scatter_tensor_coalesced", outputs, inputs, *args, **kwargs)

    def all_gather_single(self, output, input, *args, **kwargs):
        return self._issue("all_gather", _bytes(output), "all_gather_single", output, input, *args, **kwargs)

    def all_gather_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("all_gather", _bytes(outputs), "all_gather_single_coalesced", outputs, inputs, *args, **kwargs)

    def reduce_scatter_single(self, output, input, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(input), "reduce_scatter_single", output, input, *args, **kwargs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._issue("reduce_scatter", _bytes(inputs), "reduce_scatter_single_coalesced", outputs, inputs, *args, **kwargs)

    def all_to_all_single(self, output, input, *args, **kwargs):
        return self._issue("all_to_all", _bytes(input), "all_to_all_single", output, input, *args, **kwargs)

    def broadcast(self, tensors, *args, **kwargs):
        return self._issue("broadcast", _bytes(tensors), "broadcast", tensors, *args, **kwargs)

    def alltoall_base(self, output, input, *args, **kwargs):
        return self._issue("all_to_all", _bytes(input), "alltoall_base", output, input, *args, **kwargs)

    def send(self, tensors, *args, **kwargs):
        return self._issue("send", _bytes(tensors), "send", tensors, *args, **kwargs)

    def recv(self, tensors, *args, **kwargs):
        return self._issue("recv", _bytes(tensors), "recv", tensors, *args, **kwargs)

    def recv_anysource(self, tensors, *args, **kwargs):
        return self._issue("recv", _bytes(tensors), "recv_anysource", tensors, *args, **kwargs)

    def barrier(self, *args, **kwargs):
        return self._issue("barrier", 0, lambda inner, _: inner.barrier(*args, **kwargs), None)

    def reduce(self, tensors, *args, **kwargs):
        return self._issue("reduce", _bytes(tensors), "reduce", tensors, *args, **kwargs)

    def gather(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("gather", _bytes(input_tensors), "gather", output_tensors, input_tensors, *args, **kwargs)

    def scatter(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("scatter", _bytes(output_tensors), "scatter", output_tensors, input_tensors, *args, **kwargs)

    def alltoall(self, output_tensors, input_tensors, *args, **kwargs):
        return self._issue("all_to_all", _bytes(input_tensors), "alltoall", output_tensors, input_tensors, *args, **kwargs)

    def allgather_coalesced(self, output_lists, input_list, *args, **kwargs):
        return self._issue("all_gather", _bytes(output_lists), "allgather_coalesced", output_lists, input_list, *args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):  # gloo's: blocks, returns nothing
        return self.live().monitored_barrier(*args, **kwargs)

    def _start_coalescing(self, device):
        return self.live()._start_coalescing(device)

    def _end_coalescing(self, device):
        return self.live()._end_coalescing(device)

    # -- identity -------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - the name pybind calls
        return self._backend_name

    def name(self) -> str:
        return self._backend_name


_POINT_TO_POINT = frozenset({"send", "recv"})
_IN_FLIGHT_PRUNE_AT = 32  # operations kept before completed ones are looked for (async work nobody waits for)


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
        else:
            if getattr(group.recorder, "quiet", False):  # not measured so far (a handle of rank.lab_groups)
                group.recorder = recorder
            if link is not None:
                group.link = link
