"""Local SGD: each replica steps on its own, parameters are averaged every ``sync_every`` steps.

A strategy written against the catalog's plug-in points only, as DiLoCo or a
parameter server will be: one module with ``apply`` and one ``Strategy`` entry.
It wraps the optimizer step (``composition.step_wrappers``) and gives ranks
roles. With plain SGD and ``sync_every=1`` it equals synchronous data
parallelism: the average of the replicas' SGD steps is one SGD step on the
averaged gradient (which ``verify=True`` checks against one process).
"""

from __future__ import annotations

import contextlib

from labkit.strategies.catalog import Setting, Strategy


ENTRY = Strategy(
    "local_sgd", axis="dp", order=2, module=__name__,
    summary="local SGD: replicas step alone, parameters averaged every sync_every steps",
    settings=(Setting("sync_every", 1, "steps between parameter averages"),),
    roles=lambda config, rank: "leader" if rank == 0 else "follower",
)


def unregister_everywhere() -> None:
    from labkit.strategies.catalog import CATALOG

    CATALOG.pop(ENTRY.name, None)


def register_everywhere() -> None:
    from labkit.strategies.catalog import register

    register(ENTRY)


def apply(composition, dp_mesh, config) -> None:
    if composition.estimate_only:
        return
    import torch.distributed as dist

    model, group, size = composition.model, dp_mesh.get_group(), dp_mesh.size()
    steps = {"taken": 0}

    @contextlib.contextmanager
    def average_after_step(optimizer):
        yield  # optimizer.step() runs here, on this replica alone
        steps["taken"] += 1
        if steps["taken"] % config.sync_every == 0:
            for parameter in model.parameters():
                dist.all_reduce(parameter.data, group=group)
                parameter.data /= size

    composition.step_wrappers.append(average_after_step)
