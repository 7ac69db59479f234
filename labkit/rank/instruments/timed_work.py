"""A process group's work handle whose ``wait`` is seen (``timed_group.TimedGroup`` hands them out)."""

from __future__ import annotations

import torch.distributed as dist

from labkit.torch_support import torch_internals


class TimedWork(dist.Work):
    """Wraps a real work handle so its ``wait`` is seen: by the recorder, and by the group's bookkeeping.

    Send and receive have no future: their completion is noted when ``wait``
    returns. While a thread waits, the group says which of its operations it
    waits for (``TimedGroup.waiting``): that is how a rank that waits in a
    collective is told from one that computes.
    """

    def __init__(self, inner: dist.Work, recorder, on_done=None, group=None, sequence: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.recorder = recorder
        self.on_done = on_done
        self.group = group
        self.sequence = sequence

    def wait(self, timeout=None) -> bool:
        group = self.group
        if group is not None:
            group.waiting = self.sequence
        try:
            with self.recorder.waiting():
                result = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        finally:
            if group is not None and group.waiting == self.sequence:
                group.waiting = None
        if self.on_done is not None:
            self.on_done()
        elif group is not None:
            group.in_flight.pop(self.sequence, None)  # completed: nothing told the group otherwise
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
