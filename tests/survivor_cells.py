"""Cells that build distributed models on the lab's process groups, train them, and fail in every way a
notebook user makes a cell fail; shared by tests/lab/test_state_survives.py, tests/lab/test_soak.py and
bench/recovery.py.

``BUILD`` defines, on every rank: ``build()`` (a DDP module, an FSDP2 model, a tensor-parallel module on a
mesh of its own, and a group of its own), ``train(models, optimizers, group, step)`` (one step of each on
the step's batch) and ``weights(models)`` (every parameter, gathered whole). ``FAILURES``: (what, the
failing cell's code, whether it cuts a collective, the cell's time limit or None).
"""

BUILD = '''
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel

def build():
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(8, 4))
    torch.manual_seed(1)
    sharded = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(sharded)
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(2)
    tp = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), tp_mesh,
                            {"0": ColwiseParallel(), "2": RowwiseParallel()})
    group = dist.new_group(list(range(world_size)))
    models = [ddp, sharded, tp]
    return models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models], group

def train(models, optimizers, group, step):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))
    for model, optimizer in zip(models, optimizers):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    total = torch.ones(1) * step
    dist.all_reduce(total, group=group)
    return float(total)

def weights(models):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for m in models for p in m.parameters()]
'''

FAILURES = [
    ("typo on every rank", "print(undefined_name)", False),
    ("one rank raises, the other waits in an all-reduce",
     "x = torch.ones(1)\nif rank == 1:\n    raise ValueError('only here')\ndist.all_reduce(x)", True),
    ("one rank raises before backward, the other is in DDP's backward",
     "loss = models[0](torch.ones(2, 8)).sum()\nif rank == 1:\n    raise ValueError('only here')\nloss.backward()",
     True),
    ("one rank raises, the other is in FSDP's all-gather",
     "if rank == 0:\n    raise ValueError('only here')\nmodels[1](torch.ones(2, 8))", True),
    ("one rank raises, the other is in a tensor-parallel forward",
     "if rank == 0:\n    raise ValueError('only here')\nmodels[2](torch.ones(2, 8)).sum()", True),
    ("one rank raises, the other waits on the cell's own group",
     "y = torch.ones(1)\nif rank == 0:\n    raise KeyError('k')\ndist.all_reduce(y, group=group)", True),
]

# A cell stopped at its time limit: while a peer waits in a collective (cut), and between collectives (not).
TIMEOUTS = [
    ("stopped at its limit while a peer waits in an all-reduce",
     "import time\nx = torch.ones(1)\nif rank == 0:\n    time.sleep(60)\ndist.all_reduce(x)", True, 3),
    ("stopped at its limit between collectives", "import time\ntime.sleep(60)", False, 2),
]

# Trains ``STEPS`` more steps of the same models afresh and says whether they equal ``models`` bitwise.
COMPARE = ("reference, _, _ = build()\n_optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in reference]\n"
           "for _step in range(STEPS):\n    train(reference, _optimizers, group, _step)\n"
           "same = all(torch.equal(a, b) for a, b in zip(weights(models), weights(reference)))")


