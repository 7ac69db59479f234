"""The ``%lab`` commands, each described in one line: the one place a command is described.

``%lab --help`` lists them in this order, each parser takes its first line from
here, and a mistyped command is answered with the closest of these names.
"""

from __future__ import annotations

SUMMARIES = {  # in the order %lab --help lists them
    "start": "start N ranks; run again, it reuses a healthy lab with the same settings or replaces it",
    "mesh": "build a named device mesh on every rank and draw it (lab.mesh)",
    "train": "train a zoo model, or your own (--model MyNet --data train_set), under a strategy; each option is a "
             "setting of lab.train",
    "slow": "make a rank busy-wait that much longer each training step: a straggler on demand (lab.slow)",
    "link": "a simulated slow network between the ranks: set it, remove it (off) or, alone, show it (lab.link)",
    "seed": "seed torch, numpy and random on every rank: S + rank, or S everywhere with --same (lab.seed)",
    "push": "put the notebook's functions, classes, modules and values into every rank's namespace (lab.push)",
    "run": "run a script written for torchrun, unmodified, as __main__ on every rank (lab.run_script)",
    "bench": "time a collective over message sizes on the ranks' device (lab.bench_collective)",
    "checkpoint": "save the ranks' training state, or load a checkpoint resharded to these ranks (lab.save, lab.load)",
    "kill": "SIGKILL a rank's process, also during a run (lab.kill); %lab heal replaces it",
    "heal": "replace what died and go on from the newest checkpoint (lab.heal)",
    "debug": "pdb on a rank's last exception, typed here (default: the first rank that raised); breakpoint() in "
             "a %%lab cell stops there with the same prompt (lab.debug)",
    "tasks": "FN(item) for every item of ITEMS, each on whichever rank is idle (lab.tasks)",
    "ensemble": "members trained apart on the task queue, scored against their combination (lab.ensemble)",
    "join-command": "the line that, run on another machine with labkit, makes its engine join as the next rank; "
                    "--https: the machine joins as a site over one outbound HTTPS line, behind NAT (lab.join_command)",
    "sites": "the machines that joined over the lab's HTTPS line: their engines, line and bytes (lab.sites)",
    "status": "one row per rank: state, host, pid, engine, device, threads, group, coordinate (also %lab alone)",
    "who": "the ranks' variables: type; shape, dtype, device of tensors; parameters of modules; where ranks differ "
           "(lab.who)",
    "auto": "every following cell runs on the ranks, as %%lab (its output says so); %lab auto off: in the notebook",
    "timeout": "the default time limit for each cell, in seconds",
    "restart": "fresh processes with the same settings (lab.restart)",
    "stop": "stop every rank, the controller and its ports (lab.stop)",
}
CELL = "%%lab"  # the cell magic's name, where a line command has "%lab NAME"
CELL_SUMMARY = ("run the cell on every rank (or some); what they print and display labelled [rank r] (alike: once), "
                "the last value shown")
