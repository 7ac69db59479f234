"""The parameter server's rank side: servers, workers and the point-to-point link between them.

``Server`` holds one shard of the master weights and serves the workers'
pushes (synchronously, or as they come under a staleness bound); ``Worker``
pushes its gradient's shards and pulls the new weights; ``Link`` is their
traffic over the dp group, through pinned host buffers where a GPU's tensors
cross a CPU link. How and why, and the proof: ``labkit.strategies.ps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.strategies.ps_gate import StalenessGate, staleness_bound
from labkit.torch_support import torch_internals
from labkit.torch_support.host_staging import CudaFence, HostBuffer, NoFence, PinnedStaging, pinned_empty

PUSH_TAG = 71  # worker -> server: a gradient shard
PULL_TAG = 72  # server -> worker: a shard's weights


@dataclass(frozen=True)
class ServerSettings:
    """What a server reads of the run: the learning rate (scaled for asynchronous pushes) and the bound."""

    lr: float
    staleness: int  # 0: synchronous; k > 0: a worker at most k pushes ahead of the slowest


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
        self.allocate, self.fence = pinned_empty, self._cuda_fence

    def _cuda_fence(self) -> CudaFence:
        assert self.gpu is not None, "a fence is made only where a GPU's tensors cross"
        return CudaFence(self.gpu)

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

    def __init__(self, index: int, model: nn.Module, bounds, servers: int, workers: int, link: Link,
                 config: ServerSettings, device: torch.device, results: dict) -> None:
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
        sending: list[dist.Work] = []
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

