"""Exits as scripts do: exit(), sys.exit(0), sys.exit(code) on one rank, SIGTERM to itself at the end on one
rank; argv, __name__ and sys.path."""
import os
import sys

import helper_module  # beside this script: its folder is on sys.path

rank = int(os.environ["RANK"])
mode = sys.argv[1]
print(f"name {__name__} argv {sys.argv[1:]} helper {helper_module.VALUE}")
if mode == "exit":
    exit()
    print("after exit(): must not run")
elif mode == "zero":
    sys.exit(0)
elif mode == "code" and rank == 1:
    sys.exit(3)
elif mode == "nccl":
    import torch.distributed as dist

    dist.init_process_group("nccl")
elif mode == "raise" and rank == 2:
    raise ValueError("a mistake in the script")
print("end of script")
if mode == "terminate" and rank == 1:  # as a job's end would, the instant the script is done
    import signal

    os.kill(os.getpid(), signal.SIGTERM)
