"""On a rank: the trained model whole (``lab.model_state``), gathered from however the strategy split it.

Every rank takes part, since a sharded parameter (FSDP's, tensor parallelism's
DTensors) is gathered by a collective over the ranks that hold its shards; only
the ranks of the first data-parallel replica send what they hold back (the
others hold the same, or, under DiLoCo between outer steps, their own drift).
Under a pipeline each stage sends its own layers; the notebook merges them. A
parameter server's servers hold flat shards, not the model: its workers' copy is
sent. Names are the unwrapped model's (DDP's ``module.`` removed), buffers (a
batch-norm's running statistics) included, so ``net.load_state_dict(...)``
takes the result.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from labkit.rank.context import RankContext


def whole_model(context: RankContext) -> dict[str, torch.Tensor]:
    """This rank's share of the whole trained model, on the CPU ({} from ranks whose copy is not sent)."""
    state = context.train_state
    if state is None:
        raise RuntimeError("this rank has no trained model (it was restarted, or never trained): train first, "
                           "or load a checkpoint")
    parallel = state.parallel
    sends = parallel.data_share is not None and parallel.data_share[0] == 0
    whole: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, parameter in parallel.named_parameters():
            value = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()
            if sends:
                whole[name] = value.cpu().clone()
        for name, buffer in parallel.module.named_buffers():
            value = buffer.full_tensor() if isinstance(buffer, DTensor) else buffer
            if sends:
                whole[name.removeprefix("module.")] = value.cpu().clone()
    return whole
