"""Local SGD: each replica steps on its own, parameters are averaged every ``sync_every`` steps.

A strategy from outside labkit: one module, its declaration (``STRATEGY``)
beside its ``apply``, named by this package's entry point. It uses the plug-in
points DiLoCo and the parameter server use: it wraps the optimizer step
(``composition.step_wrappers``) and gives ranks roles. With plain SGD and
``sync_every=1`` it equals synchronous data parallelism: the average of the
replicas' SGD steps is one SGD step on the averaged gradient (which
``verify=True`` checks against one process).

The declaration loads without torch (the notebook reads it); ``apply`` runs on the ranks.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from labkit.strategies.catalog import Setting, Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

SYNC_EVERY = Setting("sync_every", 1, "steps between parameter averages")


def leader_or_follower(config: TrainConfig, rank: int) -> str:
    return "leader" if rank == 0 else "follower"


STRATEGY = Strategy(
    "local_sgd", axis="dp", order=2, roles=leader_or_follower,
    summary="local SGD: replicas step alone, parameters averaged every sync_every steps",
    settings=(SYNC_EVERY,),
)


def apply(composition: Composition, dp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Average the replicas' parameters after every ``sync_every``-th optimizer step."""
    if composition.estimate_only:
        return  # a whole copy per rank, as under ddp
    import torch.distributed as dist

    model, group, size = composition.model, dp_mesh.get_group(), dp_mesh.size()
    every, steps = config.setting(SYNC_EVERY), {"taken": 0}

    @contextlib.contextmanager
    def average_after_step(optimizer):
        yield  # optimizer.step() runs here, on this replica alone
        steps["taken"] += 1
        if steps["taken"] % every == 0:
            for parameter in model.parameters():
                dist.all_reduce(parameter.data, group=group)
                parameter.data /= size

    composition.step_wrappers.append(average_after_step)
