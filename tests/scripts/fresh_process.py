"""What a script finds of a fresh torchrun process: its classes pickle, its random state, its groups, its environment.

``python -m torch.distributed.run --standalone --nproc_per_node 2 fresh_process.py MODE [FOLDER]``, or
``lab.run_script`` with the same arguments. Each mode prints one line per rank, ``MODE@RANK {json}``.
"""
import json
import os
import pickle
import random
import stat
import sys
from multiprocessing.reduction import ForkingPickler

import numpy
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# The variables a torchrun worker finds in its environment (torch.distributed.run's documentation).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)


def say(mode, value):
    """``MODE@RANK {json}``: under torchrun the workers' lines come in any order, unlabelled."""
    # One write of the whole line: both workers share one stdout, and print() writes the text and its
    # newline apart, so another worker's line could land between them.
    sys.stdout.write(f"{mode}@{dist.get_rank()} {json.dumps(value)}\n")
    sys.stdout.flush()


def main():
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "pickle":
        path = os.path.join(sys.argv[2], f"net-{rank}.pt")
        torch.save(Net(), path)
        loaded = torch.load(path, weights_only=False)
        say(mode, {"loaded": type(loaded).__name__, "module": type(loaded).__module__,
                   "pickled": type(pickle.loads(pickle.dumps(Net()))) is Net,
                   "forking_pickler": type(pickle.loads(ForkingPickler.dumps(Net()))) is Net})
    elif mode == "seed":
        torch.manual_seed(0)
        random.seed(0)
        numpy.random.seed(0)
    elif mode == "draw":
        say(mode, [torch.initial_seed(), torch.rand(1).item(), random.random(), float(numpy.random.rand())])
    elif mode == "groups":
        before = len(c10d._world.pg_map)
        group = dist.new_group([0, 1])
        ones = torch.ones(1)
        dist.all_reduce(ones, group=group)
        say(mode, before)
        dist.destroy_process_group()
        return
    elif mode == "environment":
        say(mode, {"variables": {name: os.environ.get(name) for name in TORCHRUN_VARIABLES},
                   "LOSS_KIND": os.environ.get("LOSS_KIND", "default"), "argv0": sys.argv[0]})
    elif mode == "write":
        path = os.path.join(sys.argv[2], f"written-{rank}.txt")
        with open(path, "w") as handle:
            handle.write("written by the script\n")
        os.makedirs(os.path.join(sys.argv[2], f"folder-{rank}"))
        say(mode, {"file": oct(stat.S_IMODE(os.stat(path).st_mode)),
                   "folder": oct(stat.S_IMODE(os.stat(os.path.join(sys.argv[2], f"folder-{rank}")).st_mode))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
