"""Cells that build models in each state a notebook leaves them in (DDP plain and static-graph, FSDP2;
never trained, one step, three), fail in each way one rank fails (before, in, between, during and after
forward and backward), train on, and compare every parameter bitwise with the same model trained without
the failure. Used by tests/lab/test_models_in_step.py.

``BUILD`` defines, on every rank: ``build(variant)`` (a model and its optimizer, trained as the variant
says: ``(kind, steps)``), ``train(model, optimizer, step)`` (one step on the step's batch),
``same_as_without_failure(model, variant, steps)``.
"""

BUILD = '''
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

class Net(nn.Module):
    """Raises on the rank told to, inside its forward (``fail_in_forward``)."""
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)
        self.fail_in_forward = None
    def forward(self, x):
        hidden = self.first(x).relu()
        if self.fail_in_forward == rank:
            raise ValueError("only here, in forward")
        return self.second(hidden)

def batch(step):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))

def train(model, optimizer, step):
    optimizer.zero_grad()
    model(batch(step)).square().mean().backward()  # bounded: a long loop stays finite
    optimizer.step()

def wrapped(kind):
    torch.manual_seed(0)
    if kind == "fsdp":
        net = Net()
        fully_shard(net.first)
        return fully_shard(net)
    return DDP(Net(), static_graph=kind == "static ddp")

def net(model):
    return getattr(model, "module", model)

def whole(parameter):
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter.detach()

def build(variant):
    kind, steps = variant
    model = wrapped(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        train(model, optimizer, step)
    return model, optimizer

def same_as_without_failure(model, variant, steps):
    reference, optimizer = build((variant[0], 0))
    for step in range(steps):
        train(reference, optimizer, step)
    return all(torch.equal(whole(a), whole(b)) for a, b in zip(model.parameters(), reference.parameters()))
'''

# (kind, steps trained before the failing cell): never trained, one step (a DDP's buckets are rebuilt at
# the next forward), three steps (rebuilt).
VARIANTS = [(kind, steps) for kind in ("ddp", "static ddp", "fsdp") for steps in (0, 1, 3)]

# What rank 1 does in the failing cell while ranks 0 and 2 run a forward and backward of ``model``.
FAILURES = {
    "before forward": "if rank == 1:\n    raise ValueError('only here')\nmodel(batch(50)).sum().backward()",
    "in forward": "net(model).fail_in_forward = 1\ntry:\n    model(batch(50)).sum().backward()\n"
                  "finally:\n    net(model).fail_in_forward = None",
    "between forward and backward": "loss = model(batch(50)).sum()\nif rank == 1:\n    raise ValueError('only here')\n"
                                    "loss.backward()",
    "in backward": "out = model(batch(50))\nif rank == 1:\n    out.register_hook(lambda grad: 1 / 0)\n"
                   "out.sum().backward()",
    "after backward": "model(batch(50)).sum().backward()\nif rank == 1:\n    raise ValueError('only here')",
}


# -- your own model under lab.train, with a loss that raises once on one rank -------------------------

def small_net():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def classes(step, generator):
    import torch

    return torch.randn(12, 8, generator=generator), torch.randint(0, 4, (12,), generator=generator)


def cross_entropy(output, batch):
    import torch.nn.functional as F

    return F.cross_entropy(output, batch[1])


_CALLS = {"loss": 0}  # on each rank: how many times cross_entropy_failing_once ran in this process


def cross_entropy_failing_once(output, batch):
    """cross_entropy, except that its sixth call in a rank-1 process raises (once per process)."""
    import torch.distributed as dist

    _CALLS["loss"] += 1
    if dist.get_rank() == 1 and _CALLS["loss"] == 6:
        raise ValueError("the loss failed at its sixth call")
    return cross_entropy(output, batch)


# A training loop in a cell that runs until the notebook interrupts it; ``steps_done`` counts its steps.
LOOP = "for _ in range(100000):\n    train(model, optimizer, steps_done)\n    steps_done += 1"
