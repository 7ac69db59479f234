"""The parameter server's bookkeeping, without torch: who owns which elements, and when a worker may go on.

``shard_bounds(total, servers)`` splits the model's parameters, flattened into
one vector in ``model.parameters()`` order, into contiguous shards, one per
server, as even as they can be (the first ``total % servers`` get one element
more). A shard may start or end inside a parameter: servers see elements, not
layers.

``StalenessGate`` is the stale-synchronous rule (SSP, Ho et al. 2013) of an
asynchronous server. It counts each worker's pushes and holds a worker's answer
while that worker is more than ``bound`` pushes ahead of the slowest one; the
answers it releases are what the server sends back (with the weights of that
moment). ``bound=0`` is lockstep: nobody goes on until everyone has pushed.

How stale can an applied gradient be? Staleness is counted in server versions
(one per applied push): the version when a gradient is applied minus the
version of the weights it was computed from. While worker ``w`` computes on the
weights of its ``c``-th answer, every other worker ``u`` was at least ``c - k``
pushes in when that answer left (``w`` was at most ``k`` ahead), and can reach at
most ``c + k + 1`` before ``w`` pushes again (its answers stop past ``c + k``, and
``w`` is still at ``c``). So each of the ``W - 1`` others adds at most ``2k + 1``
versions: ``staleness <= (W - 1)(2k + 1)``, which ``staleness_bound`` returns and one
schedule in the tests reaches. With ``k = 0`` that is ``W - 1``: the
pushes of one round applied one after another.
"""

from __future__ import annotations


def shard_bounds(total: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous (start, end) ranges covering ``range(total)``, sizes differing by at most one."""
    if servers < 1 or total < servers:
        raise ValueError(f"cannot split {total} elements over {servers} servers: each needs at least one")
    size, extra = divmod(total, servers)
    bounds, start = [], 0
    for index in range(servers):
        end = start + size + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def staleness_bound(workers: int, bound: int) -> int:
    """The most versions an applied gradient can be behind under ``StalenessGate(workers, bound)``."""
    return (workers - 1) * (2 * bound + 1)


class StalenessGate:
    """Push counts per worker, and the answers held until their workers are within ``bound`` of the slowest."""

    def __init__(self, workers: int, bound: int) -> None:
        if workers < 1 or bound < 0:
            raise ValueError(f"a gate needs at least one worker and a bound of at least 0, got {workers}, {bound}")
        self.bound = bound
        self.pushes = [0] * workers
        self.held: list[int] = []  # workers whose answer waits, oldest first

    def lead(self, worker: int) -> int:
        """How many pushes ``worker`` is ahead of the slowest worker."""
        return self.pushes[worker] - min(self.pushes)

    def pushed(self, worker: int) -> list[int]:
        """``worker``'s push was applied: the workers to answer now (it, and any it let go on), oldest first."""
        if worker in self.held:
            raise ValueError(f"worker {worker} pushed again before it was answered")
        self.pushes[worker] += 1
        self.held.append(worker)
        ready = [held for held in self.held if self.lead(held) <= self.bound]
        self.held = [held for held in self.held if held not in ready]
        return ready
