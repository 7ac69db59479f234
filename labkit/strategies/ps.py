"""Parameter server: servers hold the master weights and the optimizer, workers compute gradients.

Ranks ``[0, servers)`` are servers, the rest workers (``W`` of them). The model's
parameters, flattened in ``model.parameters()`` order, are split into one
contiguous shard per server (``ps_gate.shard_bounds``). A server's model is its
shard alone, one flat parameter, so the run's optimizer (``config.optimizer``,
built by the loop with ``make_optimizer``) steps exactly that shard and the
memory report counts what each rank holds: servers a shard with its gradient and
optimizer state, workers the whole model and its gradient, no optimizer state.

Every step, each worker runs forward and backward on its ``1/W`` of the global
batch; its ``update`` (in place of ``optimizer.step()``) pushes each server its
shard of the gradient and pulls the shard's new weights back. All of it is
point-to-point over the lab's dp mesh group (``isend``/``irecv``), so the
instruments count every byte where it passes: each worker moves the model twice
a step, each server ``2W/servers`` times, which is the bottleneck the design
is known for. Servers take no data, own no loss, and their ``forward`` does
nothing; their work is their ``update``. The workers' loss is averaged over a
group of the workers (built once per mesh, on every rank, as ``new_group`` must).

Synchronous (``staleness=0``). A server waits for every worker's gradient shard,
averages them in worker order, steps its optimizer and sends the new shard to
every worker: one step of the averaged gradient, which is what DDP computes, so
``verify=True`` compares each worker's model (after the step's pull) and each
server's shard (a slice of the flattened reference) with one process.

Asynchronous (``staleness=k >= 1``). A server applies each gradient as it
arrives, from whichever worker (gloo receives from any source), bumps its
version, and answers that worker with the weights of that moment. To keep the
learning rate of a synchronous run, each push is applied with ``lr / W`` and
its gradient unscaled: under SGD, one push from each worker adds up to
``lr x`` the mean gradient, one synchronous step; AdamW's step does not depend
on the gradient's scale, so each push moves about ``lr / W`` and ``W`` pushes
about one synchronous step. Bounded staleness (stale-synchronous parallel): an
answer is held while its worker is more than ``k`` pushes ahead of the slowest
worker (``ps_gate.StalenessGate``). Every applied update records its staleness,
the server's version minus the version of the weights the gradient came from,
which stays within ``(W - 1)(2k + 1)`` (derived in ``ps_gate``); the run's results
carry the list (``report.strategy_results``).

One loop for every rank. The shared loop makes every rank take ``steps``
iterations; a server's iteration serves ``W`` pushes (one per worker when
synchronous, any ``W`` in arrival order when not), so servers and workers finish
together: ``steps x W`` pushes. With instruments on, every 4 steps all ranks meet
in the stop agreement (an all-reduce on WORLD). A worker reaches it after its
``4j``-th answer, a server after ``4jW`` pushes, when every worker has pushed
``4j`` times and nothing is held; so each agreement is a moment where all workers
are level (a lead of 0, as under ``k = 0``), and no worker is ever more than 4
pushes ahead, whatever ``k``. The progress lines (every ``log_every`` steps, an
all-reduce of the workers' loss) level the workers the same way. Between these
points the gate alone decides: updates are applied in arrival order, on stale
weights, and fast workers go on while slow ones compute. So the agreement bounds
asynchrony by its window but does not defeat it, and the loop keeps it as it is;
``instruments=False`` has no agreement, and only the gate bounds the run. Since
every worker takes ``steps`` steps, a worker that is slow throughout still sets
the run's length: asynchrony absorbs jitter, not a permanently slower rank.

Every receive waits within the lab's collective limit (the groups' timeout, set
for each cell): gloo's point-to-point waits have no limit of their own.

Resume continues the servers' shards, optimizers, versions and gates: a
synchronous continuation ends bit for bit where one run ends. Checkpoints are
refused (the declaration's ``no_checkpoints``): no layout yet maps flat shards
and their optimizer state back to parameters by name.

This module is the declaration (no torch) and what the ranks call; the
servers, workers and their link, with torch, are ``labkit.strategies.ps_roles``,
the bookkeeping without torch ``labkit.strategies.ps_gate``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from labkit.strategies.catalog import Setting, Strategy
from labkit.strategies.ps_gate import shard_bounds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig
    from labkit.strategies.compose import Composition

SERVERS = Setting("servers", 1, "ps: ranks that hold the weights (the first ones); the rest are workers")
STALENESS = Setting("staleness", 0, "ps: 0 synchronous; k > 0 asynchronous, a worker at most k pushes ahead of the "
                                    "slowest", minimum=0)


def workers(config: TrainConfig) -> int:
    # At least 1, so the general checks that divide by it run before ``check`` refuses a run without workers.
    return max(1, config.axis("dp") - config.setting(SERVERS))


def batch_the_workers_divide(config: TrainConfig) -> dict[str, int]:
    # The general default batch (32) rarely splits over 3 workers: without a batch given, the nearest
    # multiple of the workers (x microbatches) not above it, so the defaults alone run (32 -> 30 for 3).
    unit = workers(config) * (config.micro_batches or 1)
    return {"global_batch": max(unit, config.global_batch // unit * unit)}


def check(config: TrainConfig) -> None:
    ranks, servers, staleness = config.axis("dp"), config.setting(SERVERS), config.setting(STALENESS)
    if servers >= ranks:
        raise ValueError(f"ps with servers={servers} on {ranks} ranks leaves no worker: ranks "
                         f"[0, servers) serve, the others compute gradients; use servers <= {ranks - 1}")
    if config.verify and staleness:
        raise ValueError(f"verify=True compares with single-process training, which ps with staleness="
                         f"{staleness} cannot equal: asynchronous updates are applied in the order they "
                         f"arrive, so there is nothing deterministic to compare with. Verify with staleness=0 "
                         f"(synchronous), or train without verify")


def role(config: TrainConfig, rank: int) -> str:
    return "server" if rank < config.setting(SERVERS) else "worker"


STRATEGY = Strategy(
    "ps", axis="dp", order=2, alone=True, check=check, defaults=batch_the_workers_divide, data_parts=workers,
    roles=role, list_position=50,
    no_checkpoints="its state is split by role (servers hold flat shards of the weights and the "
                   "optimizer, workers a copy of the model) and no checkpoint layout maps it back to "
                   "parameters by name; continue a run with resume=True instead",
    summary="parameter server: servers hold the weights and the optimizer, workers push gradients and "
            "pull weights (staleness > 0: asynchronous, bounded)",
    settings=(SERVERS, STALENESS),
)


def _ignore_batch(batch: object) -> None:
    return None  # a server takes no data: its work is its update


def apply(composition: Composition, dp_mesh: DeviceMesh, config: TrainConfig) -> None:
    """This rank becomes a server (ranks below ``servers``) or a worker."""
    if composition.estimate_only:
        return  # the memory estimate counts a whole model per rank: the workers' share, an upper bound
    from labkit.strategies.ps_roles import Link, Server, ServerSettings, Worker, subgroup

    servers, world = config.setting(SERVERS), dp_mesh.size()
    staleness = config.setting(STALENESS)
    workers, rank = world - servers, dp_mesh.get_local_rank()
    model = composition.model
    bounds = shard_bounds(sum(p.numel() for p in model.parameters()), servers)
    worker_group = subgroup(dp_mesh, range(servers, world))
    link = Link(dp_mesh.get_group(), composition.device)
    composition.lockstep = not staleness  # asynchronous workers run ahead: no step where every rank stands
    if rank < servers:
        server = Server(rank, model, bounds, servers, workers, link, ServerSettings(config.lr, staleness),
                        composition.device, composition.strategy_results)
        composition.model = server.holder
        composition.data_share, composition.loss_groups = None, []
        composition.forward = _ignore_batch
        composition.update = server.serve_as_they_come if staleness else server.serve_in_step
        composition.reference_view = server.reference_view
    else:
        composition.data_share = (rank - servers, workers)
        composition.loss_groups = [(worker_group, workers)]
        composition.update = Worker(model.parameters(), bounds, link).update


_ROLES = ("PUSH_TAG", "PULL_TAG", "Link", "Server", "ServerSettings", "Worker", "ShardHolder", "subgroup")


def __getattr__(name: str) -> object:
    # The rank side's names, where code imported them before they moved to ps_roles (loaded with torch).
    if name in _ROLES:
        return getattr(importlib.import_module("labkit.strategies.ps_roles"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
