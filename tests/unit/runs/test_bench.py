"""Bus bandwidth as nccl-tests defines it, against its published factors: pure, no ranks.

nccl-tests (doc/PERFORMANCE.md): busbw = algbw x 2(n-1)/n for all-reduce,
(n-1)/n for all-gather and reduce-scatter, 1 for broadcast. The factors below are
those formulas worked out by hand for 2, 4 and 8 ranks, not recomputed from labkit.
"""

import pytest

from labkit.runs.bench import BUS_FACTOR, CollectiveBench

NCCL_TESTS_FACTORS = {
    "all_reduce": {2: 1.0, 4: 1.5, 8: 1.75},
    "all_gather": {2: 0.5, 4: 0.75, 8: 0.875},
    "reduce_scatter": {2: 0.5, 4: 0.75, 8: 0.875},
    "broadcast": {2: 1.0, 4: 1.0, 8: 1.0},
}


@pytest.mark.parametrize("operation", sorted(NCCL_TESTS_FACTORS))
def test_bus_factors_match_nccl_tests(operation):
    for ranks, factor in NCCL_TESTS_FACTORS[operation].items():
        assert BUS_FACTOR[operation](ranks) == pytest.approx(factor), (operation, ranks)


def test_bandwidths_use_the_slowest_rank_of_each_size():
    # Two sizes on four ranks: the slowest rank is rank 2 for the first size, rank 0 for the second.
    per_rank = [[0.001, 0.008], [0.002, 0.004], [0.004, 0.002], [0.003, 0.001]]
    bench = CollectiveBench("all_gather", 4, [4096, 1 << 20], per_rank, memcpy=5e9)
    assert bench.seconds == [0.004, 0.008]
    assert bench.algbw == pytest.approx([1_024_000.0, 131_072_000.0])
    assert bench.busbw == pytest.approx([768_000.0, 98_304_000.0])
    assert bench.rows()[1] == (1 << 20, 0.008, pytest.approx(131_072_000.0), pytest.approx(98_304_000.0))
    text = str(bench)
    assert text.splitlines()[0].startswith("all_gather on 4 ranks")
    assert "     4 KiB      4000 us   0.001 GB/s   0.001 GB/s" in text
    assert "     1 MiB      8000 us   0.131 GB/s   0.098 GB/s" in text
    assert text.splitlines()[-1] == "memory copy on this machine: 5.0 GB/s"
