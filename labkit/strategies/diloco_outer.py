"""DiLoCo's rank side: the outer step every replica takes, and the replicas simulated in one process.

``OuterStep`` keeps a rank's global copy, its outer momentum and the inner step
count, and wraps the optimizer step (see ``labkit.strategies.diloco`` for the
method, its state in checkpoints and its proof). ``simulate`` is that proof's
single-process reference: every replica trained on its slice of each global
batch, with its own inner optimizer, an outer step every H steps.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.torch_support.batches import chunk_rows, to_device
from labkit.torch_support.optimizers import make_optimizer
from labkit.torch_support.trainable import Trainable, declared_trainable, initial_network

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from labkit.spec.train_config import TrainConfig


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: its shard of a DTensor, or the tensor itself (a view, not a copy)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(parameter: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the parameter is held: a DTensor with its mesh and placements, so checkpoints reshard it."""
    if isinstance(parameter, DTensor):
        return DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                  shape=parameter.shape, stride=parameter.stride())
    return local


def outer_update(values, pseudo_gradients, buffers, lr: float, momentum: float) -> None:
    """Outer SGD with Nesterov momentum on ``values``, in place (torch.optim.SGD's arithmetic).

    The buffers start at zero, so the first step is torch's (buffer = gradient),
    and momentum 0 is plain SGD (torch refuses ``nesterov`` without momentum).
    """
    for value, gradient, buffer in zip(values, pseudo_gradients, buffers):
        buffer.mul_(momentum).add_(gradient)
        value.sub_(gradient.add(buffer, alpha=momentum), alpha=lr)


def average_over_replicas(flat: torch.Tensor, group, size: int) -> None:
    """The pseudo-gradients' mean over the replica group, in place (a seam the tests break on purpose)."""
    dist.all_reduce(flat, group=group)
    flat /= size


class OuterStep:
    """One rank's DiLoCo state and its outer step, run after every ``inner_steps``-th optimizer step."""

    def __init__(self, module: torch.nn.Module, replica_mesh: DeviceMesh, inner_steps: int, lr: float,
                 momentum: float) -> None:
        self.module = module
        self.named = [(name.removeprefix("module."), p) for name, p in module.named_parameters()]
        self.group, self.size = replica_mesh.get_group(), replica_mesh.size()
        self.replica = replica_mesh.get_local_rank()
        self.inner_steps, self.lr, self.momentum = inner_steps, lr, momentum
        self.taken = 0  # inner steps since training began (continuations count on)
        with torch.no_grad():
            self.global_copy = [_local(p).detach().clone() for _, p in self.named]
            self.buffers = [torch.zeros_like(value) for value in self.global_copy]

    @contextlib.contextmanager
    def around_step(self, optimizer):
        yield  # the inner optimizer steps this replica alone
        self.taken += 1
        if self.taken % self.inner_steps == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        held = [_local(p) for _, p in self.named]
        flat = torch.cat([(value - local).reshape(-1) for value, local in zip(self.global_copy, held)])
        if self.size > 1:
            average_over_replicas(flat, self.group, self.size)
        pseudo, offset = [], 0
        for value in self.global_copy:
            pseudo.append(flat[offset : offset + value.numel()].view_as(value))
            offset += value.numel()
        outer_update(self.global_copy, pseudo, self.buffers, self.lr, self.momentum)
        for local, value in zip(held, self.global_copy):
            local.copy_(value)  # in place: FSDP's shards and DDP's parameters stay the tensors they were

    def nbytes(self) -> int:
        """What DiLoCo keeps beside the inner optimizer on this rank: the global copy and its momentum."""
        return sum(t.numel() * t.element_size() for t in (*self.global_copy, *self.buffers))

    def global_parameters(self) -> dict:
        """The global copy by parameter name, held as the parameters are (DTensors where they are)."""
        return {name: _like(p, value) for (name, p), value in zip(self.named, self.global_copy)}

    # -- checkpoints (``ParallelModel.extra_state``) -------------------------

    @property
    def _own_key(self) -> str:
        return f"replica{self.replica}"

    def state_dict(self, app: dict) -> dict:
        """This rank's DiLoCo entry; makes the checkpoint's model the global copy.

        ``app`` holds this rank's ``model`` and ``optimizer`` entries. This
        replica's own parameters and inner optimizer state go under its own key,
        copied (DCP loads into what it is given: no tensor may appear twice).
        Only replica 0 saves the shared optimizer entry, so it is one replica's
        state rather than a mixture of tensors from several.
        """
        own = {"model": _cloned(app["model"]), "optimizer": _cloned(app["optimizer"])}
        agreed = self.global_parameters()
        unmatched = sorted(set(agreed) - set(app["model"]))
        if unmatched:  # the saved model would silently be this replica's, not the global copy
            raise RuntimeError(f"DiLoCo cannot name its global copy in the checkpoint: {', '.join(unmatched)} "
                               "are not in the model's state dict")
        app["model"] = {key: agreed.get(key, tensor) for key, tensor in app["model"].items()}
        if self.replica != 0:
            app.pop("optimizer")
        momentum = {name: _like(p, buffer.clone()) for (name, p), buffer in zip(self.named, self.buffers)}
        return {"inner_steps": self.taken, "replicas": self.size, "momentum": momentum, self._own_key: own}

    @torch.no_grad()
    def load_state_dict(self, entry: dict | None, optimizer) -> None:
        """After the checkpoint's model (the global copy) is loaded into the parameters: the rest.

        ``entry`` is what the checkpoint holds of ``state_dict``'s entry; None
        when it has none (saved under another strategy): the loaded model is
        then the global copy and the outer state starts afresh.
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        entry = entry or {}
        self.taken = int(entry.get("inner_steps", 0))
        for (name, p), value, buffer in zip(self.named, self.global_copy, self.buffers):
            value.copy_(_local(p))
            saved = entry.get("momentum", {}).get(name)
            if saved is None:
                buffer.zero_()
            else:
                buffer.copy_(_local(saved))
        own = entry.get(self._own_key)
        if own is not None and entry.get("replicas") == self.size:  # this replica's own place in the round
            set_state_dict(self.module, optimizer, model_state_dict=own["model"], optim_state_dict=own["optimizer"])


def _cloned(tree):
    """A copy of a state dict's tensors (nested dicts and lists kept, other values shared)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_cloned(value) for value in tree]
    return tree


@torch.enable_grad()
def simulate(config: TrainConfig, device: str | torch.device, steps: int, inner_steps: int, lr: float,
             momentum: float, chunks: int = 1, data_share: tuple[int, int] | None = (0, 1),
             trainable: Trainable | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, final) parameters of DiLoCo simulated in one process, for the replica of ``data_share``.

    Each of the R replicas trains on its slice of every global batch (the
    ranks' ``share`` of the batch: replica r takes part r of R) with its own inner
    optimizer; every H steps the replicas' pseudo-gradients are averaged and
    the outer step applied. ``chunks`` > 1 (the rounding-noise reference) sums
    each replica's gradient in parts and the pseudo-gradients in reverse order:
    the same mathematics, another rounding.
    """
    device = torch.device(device)
    replicas = config.axis("replica")
    index, parts = data_share if data_share is not None else (0, 1)
    mine = index * replicas // parts  # the data axes nest dp inside replica
    trainable = trainable or declared_trainable(config)
    models = [initial_network(trainable, config.seed, device) for _ in range(replicas)]
    initial = {name: p.detach().clone() for name, p in models[0].named_parameters()}
    optimizers = [make_optimizer(network.parameters(), config, device) for network in models]
    global_copy = [p.detach().clone() for p in models[0].parameters()]
    buffers = [torch.zeros_like(value) for value in global_copy]
    slice_size = config.global_batch // replicas
    pieces = 1 if chunks == 1 else max(2, chunks // replicas)
    pieces = pieces if slice_size % pieces == 0 else 1
    for step in range(steps):
        batch = to_device(trainable.batch(step, config.global_batch), lambda tensors: tuple(t.to(device) for t in
                                                                                             tensors))
        for network, optimizer, part in zip(models, optimizers, chunk_rows(batch, replicas)):
            optimizer.zero_grad(set_to_none=True)
            for piece in chunk_rows(part, pieces):
                (trainable.loss(trainable.call(network, piece), piece) / pieces).backward()
            optimizer.step()
        if (step + 1) % inner_steps == 0:
            with torch.no_grad():
                _simulated_outer_step(models, global_copy, buffers, lr, momentum, reverse=chunks > 1)
    return initial, {name: p.detach() for name, p in models[mine].named_parameters()}


def _simulated_outer_step(models: list[Any], global_copy: list[torch.Tensor], buffers: list[torch.Tensor], lr: float,
                          momentum: float, reverse: bool) -> None:
    held = [list(network.parameters()) for network in (reversed(models) if reverse else models)]
    pseudo = []
    for position, value in enumerate(global_copy):
        total = value - held[0][position].detach()
        for parameters in held[1:]:
            total.add_(value - parameters[position].detach())
        pseudo.append(total / len(models))
    outer_update(global_copy, pseudo, buffers, lr, momentum)
    for network in models:
        for parameter, value in zip(network.parameters(), global_copy):
            parameter.detach().copy_(value)
