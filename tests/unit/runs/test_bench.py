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


def test_a_request_that_would_time_nothing_or_forever_is_refused_with_the_bound():
    from labkit.runs.bench import check_request
    from labkit.spec.errors import LabConfigError

    assert check_request("allreduce", None, None, 3)[0] == "all_reduce"
    for iterations in (-3, 0, 10**12, 2.5, True):  # -3 printed negative times and bandwidths
        with pytest.raises(LabConfigError, match=r"iterations is a whole number from 1 to 10,000, got .*; e.g. "):
            check_request("all_reduce", [1024], iterations, 3)
    with pytest.raises(LabConfigError, match=r"warmup is a whole number from 0 to 10,000, got -1"):
        check_request("all_reduce", [1024], 5, -1)


def test_a_message_larger_than_the_ranks_memory_holds_is_refused_before_any_rank_allocates_it():
    from labkit.runs.bench import check_room
    from labkit.spec.errors import LabConfigError

    host = [("host-a", 8 * 2**30)] * 4  # four ranks share one host's 8 GiB: 2 GiB each, messages up to 512 MiB
    check_room(2**29, host)
    with pytest.raises(LabConfigError, match=r"a message of 1 TiB does not fit: each rank has about 2.1 GB free, .* "
                                             r"the largest message is 512 MiB; e.g. sizes='1KB:16MB'"):
        check_room(2**40, host)
    gpus = [("cuda:0@a", 2**30), ("cuda:1@a", 2**33)]  # one rank per GPU: the fullest GPU bounds the message
    with pytest.raises(LabConfigError, match="the largest message is 256 MiB"):
        check_room(2**30, gpus)
