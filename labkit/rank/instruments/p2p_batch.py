"""Sends and receives posted together, as torch's ``batch_isend_irecv`` posts them on nccl.

On nccl a send is a kernel that finishes only once the peer has received it; two
neighbouring pipeline stages that each send before they receive block each
other's streams for good once a message is larger than nccl's buffers. torch
avoids that by posting a batch of sends and receives as one nccl group
(``batch_isend_irecv``), but only for a group whose type is exactly
``ProcessGroup``: through a ``TimedGroup`` (a Python subclass) each operation
would be posted alone.

So, while a pipeline schedule runs (``TimedGroup.p2p_batched``), a TimedGroup
whose backend coalesces keeps the sends and receives it is given in a
``P2PBatch`` and posts them as one coalesced group when something needs them:
a wait on any of them, any other operation on the group, or the end of the
schedule's step. Posting more operations in one group than torch would is safe
(a group is matched by whatever the peer posts, alone or grouped); posting later
than torch would is bounded by the schedule itself, which never blocks its CPU
between issuing a batch and waiting for it.
"""

from __future__ import annotations

import torch.distributed as dist

from labkit.torch_support import torch_internals


class DeferredWork(dist.Work):
    """A send or receive kept in a batch: asking anything of it posts the batch first."""

    def __init__(self, batch: "P2PBatch") -> None:
        super().__init__()
        self.batch = batch
        self.real: dist.Work | None = None  # the timed work, once the batch is posted

    def _posted(self) -> dist.Work:
        if self.real is None:
            self.batch.post()
        assert self.real is not None  # posting the batch gave each of its works its timed one
        return self.real

    def wait(self, timeout=None) -> bool:
        real = self._posted()
        return real.wait() if timeout is None else real.wait(timeout)

    def is_completed(self) -> bool:
        return self._posted().is_completed()

    def is_success(self) -> bool:
        return self._posted().is_success()

    def exception(self):
        return self._posted().exception()

    def get_future(self):
        raise RuntimeError("a send or receive has no future")  # as the backends' own p2p work

    def result(self):
        return self._posted().result()

    def _source_rank(self) -> int:
        return self._posted()._source_rank()


class P2PBatch:
    """The sends and receives a ``TimedGroup`` was given on ``device`` and has not posted yet."""

    def __init__(self, group, device) -> None:
        self.group = group
        self.device = device
        self._kept: list[tuple] = []  # (kind, bytes, method name, tensors, args, kwargs, deferred work)

    def keep(self, kind: str, nbytes: int, call: str, tensors, args, kwargs) -> DeferredWork:
        deferred = DeferredWork(self)
        self._kept.append((kind, nbytes, call, tensors, args, kwargs, deferred))
        return deferred

    def post(self) -> None:
        """Post everything kept as one coalesced group; each kept work then stands for the group's work."""
        kept, self._kept = self._kept, []
        if not kept:
            return
        group = self.group
        inner = group.live()
        started = []
        torch_internals.start_coalescing(inner, self.device)
        try:
            for kind, nbytes, call, tensors, args, kwargs, _ in kept:
                started.append(group.begin_operation(kind, tensors, nbytes))
                getattr(inner, call)(tensors, *args, **kwargs)
        finally:
            work = torch_internals.end_coalescing(inner, self.device)

        for (kind, nbytes, _, tensors, _, _, deferred), (token, sequence) in zip(kept, started):
            deferred.real = group.answer_for(kind, nbytes, token, sequence, work, tensors)
