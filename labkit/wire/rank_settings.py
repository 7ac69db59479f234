"""What the notebook tells an engine when it makes it a rank: one typed shape, written on one side, read on the other.

``cluster.placement.RankPlan.settings`` fills it and ``wire.entry.become_rank``
carries it (a plain dict: it pickles with no labkit class on the engine's side);
``rank.runtime.RankRuntime`` reads it. Every key is required: every notebook
that makes engines ranks this way has sent all of them since the message
began, so a rank reads keys, never defaults that would hide a missing one.
"""

from __future__ import annotations

from typing import TypedDict


class RankSettings(TypedDict):
    """Everything an engine needs to become one rank of the lab."""

    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    threads: int  # torch's intra-op threads (and OMP_NUM_THREADS) on this rank
    check_collectives: bool  # torch compares every collective across ranks first (TORCH_DISTRIBUTED_DEBUG)
    controller_address: str  # the notebook's machine, as the ranks reach it
    interface: str | None  # None: the interface that reaches the controller (a joined engine's own first)
    controller_ports: list[int]  # the controller's ports, sorted: a rank's groups never take them
    # Where the rank sits among the ranks of its host, numbered as torchrun numbers them.
    local_rank: int
    local_world_size: int
    host_index: int
    host_count: int
