"""Count the bytes a rank moves through collectives, by kind, while a block runs.

A ``TorchDispatchMode`` sees every collective as a dispatcher op, whoever issued
it: DDP's bucketed all-reduce from inside backward, FSDP's all-gathers and
reduce-scatters, DTensor's functional collectives under TP, the pipeline's sends
and receives. It also sees every other op, which makes it too slow to leave on
while timing; the training loop meters one step with it and times the others.

Bytes are the size of the whole buffer a collective works on, as nccl-tests
counts it: the tensor for all-reduce and broadcast, the gathered output for
all-gather, the full input for reduce-scatter, the message for send and recv.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without overload) -> (kind, which argument holds the counted tensors)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "scatter_": ("scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as counter: ...``; then ``counter.bytes`` and ``counter.calls`` by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            kind, position = _C10D[name]
            self._add(kind, _bytes(args[position]))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            size = _bytes(args[0])
            if kind == "all_gather":
                size *= args[1]  # group size: the gathered output is that many inputs
            self._add(kind, size)
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, size: int) -> None:
        self.bytes[kind] += size
        self.calls[kind] += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())
