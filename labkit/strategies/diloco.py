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
alike. DiLoCo is applied last (catalog order 3), so it sees the final
parameters. The outer step is an optimizer-step wrapper: the training loop
does not change.

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
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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

    def __init__(self, module: torch.nn.Module, replica_mesh, config) -> None:
        self.module = module
        self.named = [(name.removeprefix("module."), p) for name, p in module.named_parameters()]
        self.group, self.size = replica_mesh.get_group(), replica_mesh.size()
        self.replica = replica_mesh.get_local_rank()
        self.inner_steps, self.lr, self.momentum = config.inner_steps, config.outer_lr, config.outer_momentum
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


def apply(composition, replica_mesh, config) -> None:
    """Catalog entry point: wrap the optimizer step with the outer step, on the final parameters."""
    if composition.estimate_only:
        return  # the global copy and momentum are two more copies of the local shards (not estimated)
    outer = OuterStep(composition.model, replica_mesh, config)
    composition.step_wrappers.append(outer.around_step)
    composition.extra_state["diloco"] = outer


@torch.enable_grad()
def reference_parameters(config, device, steps: int, chunks: int = 1, data_share=(0, 1)) -> tuple[dict, dict]:
    """(initial, final) parameters of DiLoCo simulated in one process, for the replica of ``data_share``.

    Each of the R replicas trains on its slice of every global batch (the
    ranks' ``batch_slice``: replica r takes part r of R) with its own inner
    optimizer; every H steps the replicas' pseudo-gradients are averaged and
    the outer step applied. ``chunks`` > 1 (the rounding-noise reference) sums
    each replica's gradient in parts and the pseudo-gradients in reverse order:
    the same mathematics, another rounding.
    """
    from labkit.torch_support.optimizers import make_optimizer
    from labkit.zoo.data import dataset_for, loss_function
    from labkit.zoo.models import build_model

    device = torch.device(device)
    replicas = config.axis("replica")
    index, parts = data_share if data_share is not None else (0, 1)
    mine = index * replicas // parts  # the data axes nest dp inside replica
    models = [build_model(config.model, config.model_config, config.seed, device) for _ in range(replicas)]
    initial = {name: p.detach().clone() for name, p in models[0].named_parameters()}
    optimizers = [make_optimizer(model.parameters(), config, device) for model in models]
    global_copy = [p.detach().clone() for p in models[0].parameters()]
    buffers = [torch.zeros_like(value) for value in global_copy]
    data = dataset_for(config.model, config.model_config, config.seed)
    loss_fn = loss_function(config.model)
    slice_size = config.global_batch // replicas
    pieces = 1 if chunks == 1 else max(2, chunks // replicas)
    pieces = pieces if slice_size % pieces == 0 else 1
    for step in range(steps):
        inputs, targets = (t.to(device) for t in data.batch(step, config.global_batch))
        for model, optimizer, part_inputs, part_targets in zip(models, optimizers, inputs.chunk(replicas),
                                                               targets.chunk(replicas)):
            optimizer.zero_grad(set_to_none=True)
            for piece_inputs, piece_targets in zip(part_inputs.chunk(pieces), part_targets.chunk(pieces)):
                (loss_fn(model(piece_inputs), piece_targets) / pieces).backward()
            optimizer.step()
        if (step + 1) % config.inner_steps == 0:
            with torch.no_grad():
                _simulated_outer_step(models, global_copy, buffers, config, reverse=chunks > 1)
    return initial, {name: p.detach() for name, p in models[mine].named_parameters()}


def _simulated_outer_step(models, global_copy, buffers, config, reverse: bool) -> None:
    held = [list(model.parameters()) for model in (reversed(models) if reverse else models)]
    pseudo = []
    for position, value in enumerate(global_copy):
        total = value - held[0][position].detach()
        for parameters in held[1:]:
            total.add_(value - parameters[position].detach())
        pseudo.append(total / len(models))
    outer_update(global_copy, pseudo, buffers, config.outer_lr, config.outer_momentum)
    for model in models:
        for parameter, value in zip(model.parameters(), global_copy):
            parameter.detach().copy_(value)
