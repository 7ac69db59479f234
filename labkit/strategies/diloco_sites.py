"""DiLoCo across sites, a site rank's side: the outer step through the lab's hub instead of an all-reduce.

A site (a machine that joined over HTTPS) trains as one DiLoCo replica, with ddp or fsdp over its own
ranks inside it. Every ``inner_steps`` (H) optimizer steps, instead of averaging pseudo-gradients over
the replica group (``diloco_outer.OuterStep``), the site's *holders* send theirs to the hub over the
site's line (``wire.sync_messages``, through the local end the agent names in ``LABKIT_SITE_SYNC``), and
get back the outer step's update, which every rank subtracts from its copy of the global weights, as
the hub does from its own: both copies stay equal to the last bit. Under ddp the site's local rank 0
is its one holder and shares what it got with the others (a broadcast inside the site); under fsdp
each rank holds a shard and talks to the hub for it.

The hub also says which data this site trains next: a *share* is (block b, slice j), the steps
b*H .. b*H+H-1 and part j of R of each of their global batches, which is what replica j of a DiLoCo
run of R replicas on one machine trains in round b. A site left out of a round (too late, or lost)
gets the hub's global weights whole (``resync``) and its next share; one that joins mid-run starts
from them. When no share is left, the hub says so and the run ends (``finished``).

On the wire: bf16 by default (``wire="bf16"``), both ways, each end rounding to nearest even as
torch does; the hub carries what the rounding of the update left over into the next round, so
nothing is lost for good. ``wire="fp32"`` sends float32.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.wire import sync_messages

SYNC_VARIABLE = "LABKIT_SITE_SYNC"  # cluster.site_agent sets it on every engine of a site


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def to_wire(flat: torch.Tensor, wire: str) -> bytes:
    """A float32 vector as the wire carries it (bf16: rounded to nearest even, 2 bytes a number)."""
    flat = flat.detach().cpu()
    if wire == "bf16":
        return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return flat.float().numpy().tobytes()


def from_wire(data: bytes | bytearray, wire: str) -> torch.Tensor:
    if wire == "bf16":
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).float()
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


class HubLink:
    """One holder's stream to the hub's outer sync."""

    def __init__(self, hub: dict, holder: int, timeout: float) -> None:
        address = os.environ.get(SYNC_VARIABLE)
        if not address:
            raise RuntimeError("DiLoCo across sites runs on the ranks of a site (a machine that joined over HTTPS): "
                               f"this rank has no {SYNC_VARIABLE}")
        host, port = address.rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=timeout)
        self.hub, self.holder = hub, holder

    def ask(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        sync_messages.send(self.socket, {**header, "run": self.hub["run"], "key": self.hub["key"],
                                     "site": self.hub["site"], "holder": self.holder}, payload)
        return sync_messages.receive(self.socket)

    def send_vector(self, op: str, data: bytes, item_bytes: int, **extra) -> tuple[dict, bytes]:
        """A vector in fragments, then the end of it; the hub's answer."""
        for offset, count, piece in sync_messages.fragments(data, item_bytes):
            sync_messages.send(self.socket, {"op": "part", "offset": offset, "count": count}, bytes(piece))
        return self.ask({"op": op, **extra})

    def receive_vector(self, numel: int, item_bytes: int) -> bytearray:
        """Fragments until the hub's end message; the vector's bytes."""
        data = bytearray(numel * item_bytes)
        while True:
            header, payload = sync_messages.receive(self.socket)
            if header["op"] == "end":
                return data
            start = header["offset"] * item_bytes
            data[start:start + len(payload)] = payload

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.close()


class HubOuterStep:
    """One site rank's DiLoCo state: its global copy, its share, and the exchange every H inner steps."""

    def __init__(self, module: torch.nn.Module, data_share: tuple[int, int], dp_group, sharded: bool,
                 config, results: dict) -> None:
        self.hub = dict(config.outer_hub)
        self.results = results  # what the rank returns: the rounds this site trained in
        self.round = 0
        self.inner_steps, self.global_batch = self.hub["inner_steps"], config.global_batch
        self.wire = self.hub["wire"]
        self.local_index, self.local_parts = data_share
        self.group = dp_group  # the site's data-parallel group (None on a site of one rank)
        self.holder = sharded or self.local_index == 0
        self.owner = dist.get_global_rank(dp_group, 0) if dp_group is not None and not sharded else None
        self.named = [(name.removeprefix("module."), p) for name, p in module.named_parameters()]
        with torch.no_grad():
            self.global_copy = torch.cat([_local(p).detach().reshape(-1).float() for _, p in self.named])
        self.taken = 0  # inner steps in this round
        self.share: tuple[int, int] | None = None
        self.done = False
        self.rounds_joined: list[int] = []
        self.link = HubLink(self.hub, self.local_index if sharded else 0, float(self.hub["timeout"])) \
            if self.holder else None
        self._start()

    # -- the loop's questions ------------------------------------------------------

    def position(self, step: int) -> tuple[int, int, int, int]:
        assert self.share is not None, "a site trains only with a share from the hub"
        block, part = self.share
        parts = self.hub["replicas"] * self.local_parts
        return block * self.inner_steps + self.taken, self.global_batch, part * self.local_parts + self.local_index, parts

    def finished(self) -> bool:
        return self.done

    @contextlib.contextmanager
    def around_step(self, optimizer):
        yield
        self.taken += 1
        if self.taken == self.inner_steps:
            self.exchange()

    # -- with the hub ---------------------------------------------------------------

    def _start(self) -> None:
        """Hello to the hub: begin from its global weights (or give it ours, the run's first), get a share."""
        answer: dict = {}
        weights = None
        if self.link is not None:
            digest = hashlib.sha256(self.global_copy.numpy().tobytes()).hexdigest()[:32]
            layout = [[name, list(_local(p).shape)] for name, p in self.named]  # what the flat vector holds
            answer, _ = self.link.ask({"op": "hello", "numel": self.global_copy.numel(), "digest": digest,
                                       "holders": self.local_parts if self.owner is None else 1, "layout": layout})
            if answer["op"] == "upload":
                answer, _ = self.link.send_vector("initial", self.global_copy.numpy().tobytes(), 4)
            if answer.get("weights"):
                weights = self.link.receive_vector(self.global_copy.numel(), 4)
        self._take(answer, weights, resync=True)

    @torch.no_grad()
    def exchange(self) -> None:
        """The outer step: our pseudo-gradient to the hub, its update (or its weights) back; the next share."""
        self.taken = 0
        held = torch.cat([_local(p).detach().reshape(-1).float().cpu() for _, p in self.named])
        answer: dict = {}
        vector = None
        if self.link is not None:
            pseudo = self.global_copy.cpu() - held
            size = 2 if self.wire == "bf16" else 4
            answer, _ = self.link.send_vector("pseudo", to_wire(pseudo, self.wire), size, round=self.round)
            if answer["op"] == "update":
                vector = self.link.receive_vector(self.global_copy.numel(), size)
            elif answer.get("weights"):
                vector = self.link.receive_vector(self.global_copy.numel(), 4)
        self._take(answer, vector, resync=answer.get("op") != "update")

    def _take(self, answer: dict, vector: bytearray | None, resync: bool) -> None:
        """Apply what the hub said (the holder heard it; under ddp it tells the site's other ranks)."""
        if self.link is not None:
            if vector is not None:
                values = from_wire(vector, "fp32" if resync else self.wire)
                self.global_copy = values if resync else self.global_copy.cpu() - values
            share = answer.get("share")
            self.round = int(answer.get("round", 0))
            self.share = None if share is None else (int(share[0]), int(share[1]))
        if self.owner is not None:
            self._share_with_site()
        self.done = self.share is None
        if not self.done:
            self.rounds_joined.append(self.round)
        self.results["sites"] = self.rounds_joined  # (again: the loop empties the results when it begins)
        with torch.no_grad():
            offset = 0
            device_copy = self.global_copy.to(self.named[0][1].device) if self.named else self.global_copy
            for _, parameter in self.named:
                local = _local(parameter)
                local.copy_(device_copy[offset:offset + local.numel()].view_as(local))
                offset += local.numel()

    def _share_with_site(self) -> None:
        """ddp inside the site: the holder's round, share and global copy to every rank of the site."""
        device = self.named[0][1].device if self.named else torch.device("cpu")
        state = torch.tensor([getattr(self, "round", 0), *(self.share or (-1, -1))], dtype=torch.int64,
                             device=device if device.type == "cuda" else "cpu")
        dist.broadcast(state, self.owner, group=self.group)
        self.round, block, part = (int(value) for value in state.tolist())
        self.share = None if block < 0 else (block, part)
        copy = self.global_copy.to(state.device)
        dist.broadcast(copy, self.owner, group=self.group)
        self.global_copy = copy.cpu()

    def nbytes(self) -> int:
        return self.global_copy.numel() * 4

    def state_dict(self, app: dict) -> dict:
        raise RuntimeError("a DiLoCo run across sites keeps its outer state on the hub: checkpoints are not taken "
                           "on its sites (the hub's global weights are the run's result)")

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


def apply(composition, config) -> None:
    """Make ``composition``'s DiLoCo step the hub's: called by ``diloco.apply`` on a site's run."""
    groups = [group for group, size in composition.loss_groups if size > 1]
    outer = HubOuterStep(composition.model, composition.data_share, groups[-1] if groups else None,
                         composition.uses("fsdp"), config, composition.strategy_results)
    composition.step_wrappers.append(outer.around_step)
    composition.batch_position = outer.position
    composition.finished = outer.finished
    composition.extra_state["diloco"] = outer
