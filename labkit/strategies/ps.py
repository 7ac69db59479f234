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
refused (catalog ``no_checkpoints``): no layout yet maps flat shards and their
optimizer state back to parameters by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.strategies.ps_gate import StalenessGate, shard_bounds, staleness_bound
from labkit.torch_support import torch_internals
from labkit.torch_support.host_staging import CudaFence, HostBuffer, NoFence, PinnedStaging, pinned_empty

PUSH_TAG = 71  # worker -> server: a gradient shard
PULL_TAG = 72  # server -> worker: a shard's weights


class ShardHolder(nn.Module):
    """A server's share of the master weights: one flat parameter, what its optimizer steps."""

    def __init__(self, index: int, values: torch.Tensor) -> None:
        super().__init__()
        self.name = f"shard{index}"  # one name per server, so two servers' shards never share a key
        self.register_parameter(self.name, nn.Parameter(values))

    @property
    def shard(self) -> nn.Parameter:
        return getattr(self, self.name)


class Link:
    """Point-to-point traffic over the dp group, in group ranks; CPU buffers where the group carries
    CPU tensors (gloo, or gloo beside nccl: receiving from any source needs gloo).

    A GPU's tensors cross such a link through pinned host buffers kept for the run
    (``host_buffer``, ``staging``): a copy from or to pageable memory makes the CPU wait
    while the driver stages it, every step, in both directions."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        cpu = any(kind.type == "cpu" for kind in torch_internals.device_types(group))
        self.device = torch.device("cpu") if cpu else device
        self.gpu = device if cpu and device.type == "cuda" else None  # whose tensors cross through host memory
        # How pinned buffers and their fences are made: the unit tests give stand-ins (a CPU build cannot pin).
        self.allocate, self.fence = pinned_empty, lambda: CudaFence(self.gpu)

    def host_buffer(self, numel: int) -> HostBuffer:
        """A flat buffer on the link's device, kept for reuse; pinned and fenced where a GPU's tensors cross."""
        if self.gpu is None:
            return HostBuffer(numel, torch.get_default_dtype(),
                              allocate=lambda size, dtype: torch.empty(size, dtype=dtype, device=self.device),
                              fence=NoFence)
        return HostBuffer(numel, torch.get_default_dtype(), allocate=self.allocate, fence=self.fence)

    def staging(self) -> PinnedStaging | None:
        """Copies to the GPU through pinned buffers, where a GPU's tensors cross; else none is needed."""
        if self.gpu is None:
            return None
        return PinnedStaging(self.gpu, allocate=self.allocate, fence=self.fence)

    def send(self, tensor: torch.Tensor, to: int, tag: int):
        return dist.isend(tensor, group=self.group, group_dst=to, tag=tag)

    def recv(self, tensor: torch.Tensor, source: int, tag: int):
        return dist.irecv(tensor, group=self.group, group_src=source, tag=tag)

    def recv_any(self, tensor: torch.Tensor, tag: int) -> int:
        """Receive from whichever rank sends first; return its group rank."""
        work = dist.irecv(tensor, group=self.group, tag=tag)
        self.wait_all([work])
        return torch_internals.work_source_rank(work)

    def wait_all(self, works) -> None:
        """Wait within the lab's collective limit: gloo's point-to-point waits take no group timeout
        of their own, and a wait blocked in gloo does not answer the lab's interrupt either."""
        limit = _timeout_of(self.group)
        for work in works:
            if limit is None:
                work.wait()
            else:
                work.wait(limit)


class Worker:
    """A worker's update: push each server its shard of the gradient, pull the shard's new weights."""

    def __init__(self, parameters, bounds, link: Link) -> None:
        self.parameters = list(parameters)
        self.bounds = bounds
        self.link = link
        self.weights = link.host_buffer(bounds[-1][1])  # the pulled weights, copied from here to the parameters
        self.outgoing = link.host_buffer(bounds[-1][1]) if link.gpu is not None else None  # a GPU's gradient

    @torch.no_grad()
    def update(self, optimizer) -> None:
        gradients = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                               for p in self.parameters])
        if self.outgoing is None:
            gradients = gradients.to(self.link.device)
        else:  # a blocking copy: gloo reads the buffer on the CPU as soon as the sends are posted
            gradients = self.outgoing.acquire().copy_(gradients)
        weights = self.weights.acquire()  # the last pull's copies to the parameters have run
        # Every receive is posted before any wait, so no server waits on a worker waiting on it.
        works = [self.link.send(gradients[start:end], server, PUSH_TAG)
                 for server, (start, end) in enumerate(self.bounds)]
        works += [self.link.recv(weights[start:end], server, PULL_TAG)
                  for server, (start, end) in enumerate(self.bounds)]
        self.link.wait_all(works)
        offset = 0
        for parameter in self.parameters:
            # From pinned memory to a GPU this is only enqueued; the release below fences the buffer
            # until it has run. On the host, or GPU to GPU, non_blocking changes nothing.
            parameter.copy_(weights[offset : offset + parameter.numel()].view_as(parameter), non_blocking=True)
            offset += parameter.numel()
        self.weights.release()


class Server:
    """One server: its shard of the master weights, and how it serves one iteration's pushes."""

    def __init__(self, index: int, model: nn.Module, bounds, servers: int, workers: int, link: Link, config,
                 device: torch.device, results: dict) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        start, end = bounds[index]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        self.holder = ShardHolder(index, flat[start:end].clone().to(device))
        self.start, self.end = start, end
        self.servers, self.workers, self.link, self.device = servers, workers, link, device
        self.lr, self.bound = config.lr, config.staleness
        self.inbox = [torch.empty(end - start, device=link.device) for _ in range(workers)]
        self.staging = link.staging()  # each applied gradient's way to a GPU (none where no GPU's tensors cross)
        # Pinned answers of one iteration, kept for the next: one per answer in flight, at most 2W - 1
        # (W pushes, and up to W - 1 held from the last iteration: the slowest worker is never held).
        self.answers: list[HostBuffer] = []
        self.gate = StalenessGate(workers, self.bound)
        self.version = 0  # pushes applied (asynchronous) or steps taken (synchronous)
        self.answered = [0] * workers  # the version of the weights each worker last received
        self.results = results  # the run's strategy results (the loop empties them at each run's start)
        self._total = self._worst = 0  # this run's staleness: sum and largest

    def reference_view(self, reference: dict) -> dict:
        """What this server holds of single-process parameters: its slice of them, flattened."""
        flat = torch.cat([reference[name].reshape(-1) for name in self.names])
        return {self.holder.name: flat[self.start : self.end]}

    def _worker(self, group_rank: int) -> int:
        return group_rank - self.servers

    def _apply(self, gradient: torch.Tensor, optimizer) -> None:
        if self.staging is None:
            self.holder.shard.grad = gradient.to(self.device)
        else:  # copied to pinned memory on the CPU: the inbox it came from can take the next push at once
            (self.holder.shard.grad,) = self.staging.to_device((gradient,))
        optimizer.step()

    def _answer(self, index: int, copy: bool) -> torch.Tensor:
        """The shard's weights on the link's device, to send: from a GPU over a CPU link, in this
        iteration's ``index``-th pinned answer buffer; else a copy when ``copy`` asks for one."""
        shard = self.holder.shard.detach()
        if self.link.gpu is None:
            return shard.to(self.link.device, copy=copy)
        while len(self.answers) <= index:
            self.answers.append(self.link.host_buffer(self.end - self.start))
        # A blocking copy, read by gloo on the CPU next; free again once the iteration's sends are waited.
        return self.answers[index].acquire().copy_(shard)

    def _record(self, staleness: int) -> None:
        if "staleness" not in self.results:  # a new run (the loop empties the results): count afresh
            self.results["staleness"] = []
            self.results["staleness_bound"] = staleness_bound(self.workers, self.bound) if self.bound else 0
            self._total = self._worst = 0
        self.results["staleness"].append(staleness)
        # Running sums: a long run applies tens of thousands of updates, each would re-sum the list.
        self._total, self._worst = self._total + staleness, max(self._worst, staleness)
        count = len(self.results["staleness"])
        self.results["summary"] = (f"{self.holder.name}: {count} updates applied, staleness mean "
                                   f"{self._total / count:.2f}, max {self._worst} "
                                   f"(bound {self.results['staleness_bound']})")

    @torch.no_grad()
    def serve_in_step(self, optimizer) -> None:
        """Synchronous: every worker's shard of the gradient, averaged in worker order; one step; answer all."""
        sources = range(self.servers, self.servers + self.workers)
        self.link.wait_all([self.link.recv(box, source, PUSH_TAG) for box, source in zip(self.inbox, sources)])
        total = self.inbox[0].clone()
        for box in self.inbox[1:]:
            total += box
        self._apply(total / self.workers, optimizer)
        self.version += 1
        self._record(0)  # every gradient was computed from the weights it is applied to
        answer = self._answer(0, copy=False)
        self.link.wait_all([self.link.send(answer, source, PULL_TAG) for source in sources])

    @torch.no_grad()
    def serve_as_they_come(self, optimizer) -> None:
        """Asynchronous: ``W`` pushes in arrival order, each applied at once; answers as the gate allows."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr / self.workers  # W pushes make one synchronous step (module docstring)
        sending = []
        box = self.inbox[0]
        for _ in range(self.workers):
            worker = self._worker(self.link.recv_any(box, PUSH_TAG))
            staleness = self.version - self.answered[worker]
            self._apply(box, optimizer)
            self.version += 1
            self._record(staleness)
            for ready in self.gate.pushed(worker):
                # A copy: later pushes change the shard while this answer may still be in flight.
                answer = self._answer(len(sending), copy=True)
                self.answered[ready] = self.version
                sending.append(self.link.send(answer, ready + self.servers, PULL_TAG))
        self.link.wait_all(sending)


def _timeout_of(group):
    """The group's current collective limit (the lab sets it for each cell), for groups made now."""
    for kind in torch_internals.device_types(group):
        limit = torch_internals.backend_timeout(group, kind)
        if limit is not None:
            return limit
    return None


def subgroup(dp_mesh, group_ranks) -> dist.ProcessGroup:
    """A group of some of the mesh's ranks, made once per mesh (every rank must make it, in the same order);
    it lives and goes with the mesh, which the lab keeps per process-group generation."""
    made = dp_mesh.__dict__.setdefault("_labkit_subgroups", {})
    key = tuple(group_ranks)
    if key not in made:
        group = dp_mesh.get_group()
        ranks = [dist.get_global_rank(group, rank) for rank in key]
        made[key] = dist.new_group(ranks, timeout=_timeout_of(group))
    return made[key]


def _ignore_batch(inputs, targets):
    return None  # a server takes no data: its work is its update


def apply(composition, dp_mesh, config) -> None:
    """Catalog entry point: this rank becomes a server (ranks below ``servers``) or a worker."""
    if composition.estimate_only:
        return  # the memory estimate counts a whole model per rank: the workers' share, an upper bound
    servers, world = config.servers, dp_mesh.size()
    workers, rank = world - servers, dp_mesh.get_local_rank()
    model = composition.model
    bounds = shard_bounds(sum(p.numel() for p in model.parameters()), servers)
    worker_group = subgroup(dp_mesh, range(servers, world))
    link = Link(dp_mesh.get_group(), composition.device)
    if rank < servers:
        server = Server(rank, model, bounds, servers, workers, link, config, composition.device,
                        composition.strategy_results)
        composition.model = server.holder
        composition.data_share, composition.loss_groups = None, []
        composition.forward = _ignore_batch
        composition.update = server.serve_as_they_come if config.staleness else server.serve_in_step
        composition.reference_view = server.reference_view
    else:
        composition.data_share = (rank - servers, workers)
        composition.loss_groups = [(worker_group, workers)]
        composition.update = Worker(model.parameters(), bounds, link).update
