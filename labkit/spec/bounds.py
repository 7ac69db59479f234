"""The largest (and smallest) values the lab takes for a count or a rate, each with the reason for its bound.

A value past these is not a setting anyone means: it is a typo (``--lr 1e308``
for ``1e-3``) or a probe, and accepting it costs the user a hung cell, a raw
error from deep inside torch, or numbers that lie (negative times). So each is
refused in the notebook, before any rank works, with the bound and an example.
Pure: no processes, no torch.
"""

from __future__ import annotations

import math

from labkit.spec.errors import LabConfigError

# A learning rate above 10 diverges at the first step for every optimizer the lab offers (AdamW moves each
# weight by about lr per step; SGD by lr x the gradient): past it is a typo, such as 1e308 for 1e-3.
MAX_LR = 10.0
# Long runs continue in parts (lab.train(steps=N, resume=True)); a single call past ten million steps is a typo.
MAX_STEPS = 10_000_000
# Samples in one step's global batch: far past any batch a lab trains, and small enough that a rank can hold it.
MAX_GLOBAL_BATCH = 2**20
# Gradient-accumulation steps or pipeline micro-batches in one step.
MAX_MICRO_BATCHES = 1024
# Repetitions of one collective per message size: nccl-tests' default is 20, and the lab's at most 200.
MAX_BENCH_ITERATIONS = 10_000
# Requeues of one task after its rank was lost: each needs a rank to die while running it.
MAX_TASK_RETRIES = 1000
# Ensemble members per rank: the queue trains them one after another on each rank.
MAX_MEMBERS_PER_RANK = 64
# Under vary="lr" member i's rate is lr x 2 ** (i - (members - 1) / 2): 16 members already span 2**15 (~33,000x).
MAX_LR_MEMBERS = 16


def check_whole(name: str, value: object, most: int, example: str, least: int = 1) -> int:
    """``value`` as a whole number from ``least`` to ``most``; else LabConfigError with the bound and ``example``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise LabConfigError(f"{name} is a whole number from {least} to {most:,}, got {value!r}; e.g. {example}")
    return value


def check_lr(name: str, value: object, example: str = "lr=1e-3") -> float:
    """A learning rate: a number above 0 and at most ``MAX_LR``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_LR:
        raise LabConfigError(f"{name} is a learning rate above 0 and at most {MAX_LR:g} (past that training "
                             f"diverges at once), got {value!r}; e.g. {example}")
    return float(value)


def lr_spread(members: int) -> float:
    """How far the largest learning rate of a ``vary="lr"`` ensemble is above its middle one (the factor)."""
    return 2.0 ** ((members - 1) / 2)


def largest_member_lr(lr: float, members: int) -> float:
    return lr * lr_spread(members) if members <= MAX_LR_MEMBERS else math.inf
