"""Collective benchmark: time, algorithm bandwidth and bus bandwidth over message sizes.

As nccl-tests reports them: for a message of S bytes taking t seconds,
algorithm bandwidth is S / t, and bus bandwidth scales it by what each rank
must move over its links in the usual ring algorithm, so that numbers compare
across rank counts: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter (S being the whole gathered or scattered buffer), 1 for
broadcast. Beside them, the copy bandwidth of the ranks' device: host memory for
CPU ranks (on one machine gloo's transport is memory, so that is the ceiling),
device-to-device for GPU ranks. On GPUs the messages live on the rank's device
and the timing waits for the device (``torch.cuda.synchronize``) before reading
the clock, since a collective returns before the GPU has run it.

``labkit.rank.bench`` measures on the ranks (on the default process group,
uninstrumented); ``CollectiveBench`` here is the notebook's table and picture.
"""

from __future__ import annotations

import io
from collections import Counter
from typing import TYPE_CHECKING

from labkit.rank.bench import free_memory, measure, memcpy_bandwidth
from labkit.spec.bounds import MAX_BENCH_ITERATIONS, check_whole
from labkit.spec.errors import LabConfigError
from labkit.units import format_binary, format_bytes

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
DEFAULT_SIZES = tuple(2**power for power in range(10, 25, 2))  # 1 KiB .. 16 MiB
# A rank holds a message and a working copy of about its size (the collective's own buffers), and the
# benchmark takes at most half of the rank's share of free memory: the largest message is a quarter of it.
MESSAGE_SHARE = 4


class CollectiveBench:
    """One operation over sizes: the slowest rank's time per size, bandwidths, and a picture."""

    def __init__(self, operation: str, world_size: int, sizes, per_rank: list[list[float]], memcpy: float,
                 device_type: str = "cpu") -> None:
        self.operation = operation
        self.device_type = device_type
        self.ceiling_name = "device-to-device copy on the GPU" if device_type == "cuda" else "memory copy on this machine"
        self.world_size = world_size
        self.sizes = list(sizes)
        self.seconds = [max(times[i] for times in per_rank) for i in range(len(self.sizes))]
        self.memcpy = memcpy
        factor = BUS_FACTOR[operation](world_size)
        self.algbw = [size / seconds for size, seconds in zip(self.sizes, self.seconds)]
        self.busbw = [bandwidth * factor for bandwidth in self.algbw]

    def rows(self) -> list[tuple[int, float, float, float]]:
        return list(zip(self.sizes, self.seconds, self.algbw, self.busbw))

    def __str__(self) -> str:
        lines = [
            f"{self.operation} on {self.world_size} ranks (slowest rank; bus bandwidth as nccl-tests counts it)",
            f"{'size':>10}  {'time':>10}  {'algbw':>10}  {'busbw':>10}",
        ]
        for size, seconds, algbw, busbw in self.rows():
            lines.append(f"{format_binary(size):>10}  {seconds * 1e6:>8.0f} us  {algbw / 1e9:>6.3f} GB/s  {busbw / 1e9:>6.3f} GB/s")
        lines.append(f"{self.ceiling_name}: {self.memcpy / 1e9:.1f} GB/s")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def figure(self):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(7, 3.6), dpi=80, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.plot(self.sizes, [b / 1e9 for b in self.algbw], marker="o", label="algorithm bandwidth")
        axes.plot(self.sizes, [b / 1e9 for b in self.busbw], marker="s", label="bus bandwidth")
        axes.axhline(self.memcpy / 1e9, color="#555555", linestyle="--", label=f"{self.ceiling_name} (ceiling)")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("message size (bytes)")
        axes.set_ylabel("GB/s")
        axes.set_title(f"{self.operation}, {self.world_size} ranks", fontsize=10)
        axes.legend(fontsize=8)
        return figure

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.figure().canvas.print_png(buffer)
        return buffer.getvalue()


def check_request(operation, sizes, iterations, warmup) -> tuple[str, list[int]]:
    """(the collective's name, the sizes) of a benchmark request; LabConfigError, with the bound, for a value
    that would time nothing or forever (negative repetitions print negative times)."""
    name = operation.replace("allreduce", "all_reduce").replace("allgather", "all_gather") \
        if isinstance(operation, str) else operation
    name = name.replace("reducescatter", "reduce_scatter") if isinstance(name, str) else name
    if name not in OPERATIONS:
        raise LabConfigError(f"unknown collective {operation!r}: choose {', '.join(OPERATIONS)}")
    sizes = list(sizes or DEFAULT_SIZES)
    if not sizes or any(isinstance(size, bool) or not isinstance(size, int) or size < 4 for size in sizes):
        raise LabConfigError("sizes are message sizes in bytes, each at least 4, e.g. sizes=[1024, 2**20]")
    if iterations is not None:
        check_whole("iterations", iterations, MAX_BENCH_ITERATIONS, "iterations=20 (left out: more for small sizes)")
    check_whole("warmup", warmup, MAX_BENCH_ITERATIONS, "warmup=3", least=0)
    return name, sizes


def check_room(largest: int, free: list[tuple[str, int]]) -> None:
    """Refuse a message larger than the ranks' memory holds (``free``: each rank's place and bytes free there),
    before any rank allocates it."""
    sharing = Counter(place for place, _ in free)  # ranks of one host share its memory (one GPU: its rank)
    share = min(bytes_free // sharing[place] for place, bytes_free in free)
    most = share // MESSAGE_SHARE
    if largest > most:
        fits = format_binary(2 ** (most.bit_length() - 1)) if most >= 4 else "nothing"
        raise LabConfigError(f"a message of {format_binary(largest)} does not fit: each rank has about "
                             f"{format_bytes(share)} free, and holds a message and a working copy of it within "
                             f"half of that, so the largest message is {fits}; e.g. sizes='1KB:16MB'")


def run_benchmark(session: Session, operation: str, sizes, iterations: int | None, warmup: int,
                  timeout: float) -> CollectiveBench:
    """Notebook side of ``Lab.bench_collective``: check the request, time each size, gather."""
    name, sizes = check_request(operation, sizes, iterations, warmup)
    if max(sizes) > max(DEFAULT_SIZES):  # the defaults fit any rank: only a larger message asks the ranks
        check_room(max(sizes), session.run(free_memory, timeout=timeout))
    by_size = []
    for size in sizes:  # one call per size, each under the time limit
        count = iterations or max(5, min(200, 2**24 // size))
        by_size.append(session.run(measure, name, [size], count, warmup, timeout=timeout))
    per_rank = [[by_size[i][rank][0] for i in range(len(sizes))] for rank in range(session.world_size)]
    memcpy = session.call([0], memcpy_bandwidth, (), timeout)[0]
    return CollectiveBench(name, session.world_size, sizes, per_rank, memcpy, session.plan.device_type)
