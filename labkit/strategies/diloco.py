"""DiLoCo: replicas train alone for H steps, then one outer step joins them (Douillard et al. 2023).

Each replica (one rank, or a sub-mesh along the ``replica`` axis with ddp, fsdp,
tp or pp inside it) takes ``inner_steps`` (H) steps of the run's own optimizer
(AdamW by default) on its own slice of every global batch. Then every replica
computes its pseudo-gradient, the global copy minus its parameters (how far H
steps moved it, with the sign of a gradient), the pseudo-gradients are averaged
over the replica axis, and an outer SGD with Nesterov momentum (``outer_lr``,
``outer_momentum``) applies the average to the global copy. Every replica then
continues from the new global copy. The replicas talk once every H steps
instead of every step, which is the point: H times fewer bytes than DDP.

The replicas hold the same sharding (the same inner strategy on the same shape
of sub-mesh), so the average is one all-reduce of the *local shards* over the
replica group: a flat buffer of what this rank holds, FSDP shards and TP slices
alike. DiLoCo is applied last (order 3), so it sees the final parameters. The
outer step is an optimizer-step wrapper: the training loop does not change.

State. ``OuterStep`` keeps the global copy, the momentum buffers and the inner
step count; it lives in the rank's ``TrainState`` (through the step wrapper),
so ``resume=True`` continues exactly. For checkpoints it is the composition's
extra state ``"diloco"``: the checkpoint's model is the global copy (what every
replica agrees on, and what another strategy loads), and each replica's own
parameters and inner optimizer state are saved beside it, so a reloaded run
with the same number of replicas continues bit for bit. Loaded with another
number of replicas, every replica starts from the global copy.

Proof. DiLoCo is not one-process SGD, so ``reference_parameters`` simulates the
replicas in one process (each on its slice, with its own inner optimizer, an
outer step every H), and ``verify`` compares every rank with its own replica.
With H=1, outer_lr=1, no momentum and inner SGD it is synchronous data
parallelism again.

This module is the declaration (no torch) and what the ranks call; the outer
step and the simulation, with torch, are ``labkit.strategies.diloco_outer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.strategies.catalog import Setting, Strategy

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition
    from labkit.torch_support.trainable import Trainable

INNER_STEPS = Setting("inner_steps", 10, "DiLoCo: inner optimizer steps between outer steps (H)")
OUTER_LR = Setting("outer_lr", 0.7, "DiLoCo: outer learning rate", below=10.0)  # as lr: spec.bounds.MAX_LR
OUTER_MOMENTUM = Setting("outer_momentum", 0.9, "DiLoCo: outer Nesterov momentum (0: plain SGD)", minimum=0.0,
                         below=1.0)

STRATEGY = Strategy(
    # Last (order 3): the outer step works on the final, possibly sharded, parameters.
    "diloco", axis="replica", order=3, state_copies=2, list_position=60,  # the global copy and its outer momentum
    summary="DiLoCo: replicas take inner_steps optimizer steps alone, then an outer Nesterov step on "
            "their averaged parameter change",
    settings=(INNER_STEPS, OUTER_LR, OUTER_MOMENTUM),
)


def apply(composition: Composition, replica_mesh: DeviceMesh, config: TrainConfig) -> None:
    """Wrap the optimizer step with the outer step, on the final parameters."""
    if composition.estimate_only:
        return  # the global copy and momentum are two more copies of the local shards (not estimated)
    composition.lockstep = False  # nothing crosses between replicas but the outer step: no agreement a step either
    if config.outer_hub is not None:  # a site's share of a run across sites: the hub takes the outer step
        from labkit.strategies import diloco_sites

        diloco_sites.apply(composition, config)
        return
    from labkit.strategies.diloco_outer import OuterStep

    outer = OuterStep(composition.model, replica_mesh, config.setting(INNER_STEPS), config.setting(OUTER_LR),
                      config.setting(OUTER_MOMENTUM))
    composition.step_wrappers.append(outer.around_step)
    composition.extra_state["diloco"] = outer


def reference_parameters(config: TrainConfig, device: str | torch.device, steps: int, chunks: int = 1,
                         data_share: tuple[int, int] | None = (0, 1), trainable: Trainable | None = None,
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, final) parameters of DiLoCo simulated in one process, for the replica of ``data_share``
    (``diloco_outer.simulate``): what ``verify`` compares this strategy's ranks with."""
    from labkit.strategies.diloco_outer import simulate

    return simulate(config, device, steps, config.setting(INNER_STEPS), config.setting(OUTER_LR),
                    config.setting(OUTER_MOMENTUM), chunks=chunks, data_share=data_share, trainable=trainable)
