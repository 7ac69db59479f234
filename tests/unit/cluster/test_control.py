"""The control channel between notebook and ranks, through a real rendezvous store in this process: no ranks.

The notebook side (``labkit.cluster.control.ControlRequests``) writes its request
into a torch ``TCPStore`` and bumps a version; the rank side
(``labkit.rank.control.ControlChannel``) reads the request when the version changed.
"""

import json
import math
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from labkit.cluster.control import ControlRequests
from labkit.rank.control import ControlChannel
from labkit.spec.errors import LabConfigError, LabError
from labkit.wire.store_keys import REQUEST_KEY, SLOW_KEY, STOP_KEY

WORLD = 4
LIMIT = 300.0  # the lab's time limit for work: a delay stays below it


@pytest.fixture
def store():
    """A store served as rank 0 serves the lab's: on a socket it opened itself."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False, timeout=timedelta(seconds=5),
                         master_listen_fd=listener.detach(), use_libuv=True)


@pytest.fixture
def requests(store):
    attached = ControlRequests()
    attached.attach("127.0.0.1", store.port)
    return attached


def stored(store):
    return json.loads(store.get(REQUEST_KEY))


def channel(store, rank):
    return ControlChannel(store, rank, poll_seconds=0)


# -- notebook side ----------------------------------------------------------------


def test_the_store_holds_stop_and_slowdowns_by_rank(requests, store):
    requests.request_stop()
    requests.set_slowdown(2, 0.03, WORLD, LIMIT)
    assert stored(store) == {STOP_KEY: True, SLOW_KEY: {"2": 0.03}}
    requests.request_stop(False)
    assert stored(store) == {STOP_KEY: False, SLOW_KEY: {"2": 0.03}}


def test_nothing_is_sent_before_ranks_exist_or_when_nothing_changes(store):
    requests = ControlRequests()
    requests.set_slowdown(1, 0.5, WORLD, LIMIT)  # no store yet: kept, not sent
    requests.request_stop(False)  # the default: not even a connection
    assert requests._client is None and not store.check([REQUEST_KEY])
    requests.attach("127.0.0.1", store.port)  # a new group: standing requests are written at once
    assert stored(store) == {STOP_KEY: False, SLOW_KEY: {"1": 0.5}}


def test_slowdown_messages_say_what_changed(requests):
    assert requests.set_slowdown(1, 0.02, WORLD, LIMIT) == "rank 1 now takes 20 ms longer per training step"
    assert requests.set_slowdown(1, 2, WORLD, LIMIT) == "rank 1 now takes 2000 ms longer per training step"
    assert requests.slow == {1: 2.0} and isinstance(requests.slow[1], float)
    assert requests.set_slowdown(1, None, WORLD, LIMIT) == "rank 1 runs at its own speed again"


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_no_slowdown_removes_the_rank(requests, store, off):
    requests.set_slowdown(0, 0.01, WORLD, LIMIT)
    requests.set_slowdown(3, 0.02, WORLD, LIMIT)
    requests.set_slowdown(0, off, WORLD, LIMIT)
    assert requests.slow == {3: 0.02}
    assert stored(store)[SLOW_KEY] == {"3": 0.02}
    requests.set_slowdown(2, off, WORLD, LIMIT)  # a rank never slowed: nothing to remove, no error
    assert requests.slow == {3: 0.02}


@pytest.mark.parametrize("rank", [-1, WORLD, 99, True, False, "1", 1.0, None])
def test_a_bad_rank_is_refused_with_the_valid_range(requests, store, rank):
    with pytest.raises(LabConfigError, match=r"rank must be between 0 and 3, got "):
        requests.set_slowdown(rank, 0.01, WORLD, LIMIT)
    assert requests.slow == {} and not store.check([REQUEST_KEY])  # nothing written


@pytest.mark.parametrize("seconds", [-0.001, -1, math.inf, math.nan, True, False, "30ms", [0.1], LIMIT, 1e9])
def test_a_bad_delay_is_refused(requests, store, seconds):
    requests.set_slowdown(1, 0.01, WORLD, LIMIT)
    with pytest.raises(LabConfigError, match=r"the delay is a number of seconds from 0 up to, not including, the "
                                             r"lab's time limit \(300 s.*\), got .*; e.g. 0.03 \(%lab slow 1 30ms\)"):
        requests.set_slowdown(1, seconds, WORLD, LIMIT)
    assert requests.slow == {1: 0.01}  # the earlier request stands
    assert stored(store)[SLOW_KEY] == {"1": 0.01}


def test_a_shrunk_lab_forgets_requests_for_ranks_it_no_longer_has(requests):
    requests.set_slowdown(1, 0.01, WORLD, LIMIT)
    requests.set_slowdown(3, 0.02, WORLD, LIMIT)
    requests.forget_ranks_from(3)
    assert requests.slow == {1: 0.01}


def test_an_unreachable_store_is_an_error_that_says_what_to_do():
    requests = ControlRequests()
    requests.attach("127.0.0.1", 9)  # nothing listens on the discard port
    with pytest.raises(LabError, match="could not reach the ranks' store at 127.0.0.1:9.*lab.heal"):
        requests.request_stop()


# -- rank side --------------------------------------------------------------------


def test_each_rank_reads_its_own_delay_and_the_shared_stop(requests, store):
    requests.set_slowdown(2, 0.03, WORLD, LIMIT)
    requests.request_stop()
    ranks = [channel(store, rank) for rank in range(WORLD)]
    for each in ranks:
        each.poll()
    assert [each.delay for each in ranks] == [0.0, 0.0, 0.03, 0.0]
    assert all(each.stop_requested for each in ranks)


def test_a_channel_sees_later_changes_and_nothing_before_any_request(requests, store):
    rank_one = channel(store, 1)
    rank_one.poll()  # nothing was ever written: defaults
    assert (rank_one.stop_requested, rank_one.delay) == (False, 0.0)
    requests.set_slowdown(1, 0.5, WORLD, LIMIT)
    rank_one.poll()
    assert rank_one.delay == 0.5
    requests.set_slowdown(1, None, WORLD, LIMIT)
    rank_one.poll()
    assert rank_one.delay == 0.0


def test_polls_are_spaced_so_a_step_rarely_pays_a_round_trip(requests, store):
    spaced = ControlChannel(store, 0, poll_seconds=60)
    spaced.poll()
    requests.request_stop()
    spaced.poll()  # within its period: not asked again
    assert not spaced.stop_requested


def test_without_a_store_nothing_is_ever_requested():
    alone = ControlChannel(None, 0)
    alone.poll()
    assert (alone.stop_requested, alone.delay, alone.spend_delay()) == (False, 0.0, 0.0)


def test_spend_delay_busy_waits_the_delay(requests, store):
    import time

    requests.set_slowdown(0, 0.02, WORLD, LIMIT)
    rank_zero = channel(store, 0)
    rank_zero.poll()
    began = time.perf_counter()
    assert rank_zero.spend_delay() == 0.02
    assert time.perf_counter() - began >= 0.02


def test_a_gpu_rank_spends_its_slowdown_in_its_stream_not_on_its_cpu(monkeypatch):
    import time

    import torch

    from labkit.rank.instruments import gpu_delay

    held = []
    monkeypatch.setattr(gpu_delay.StreamDelay, "calibrate", lambda self: 1e9)  # cycles per second
    monkeypatch.setattr(gpu_delay, "spin_gpu", lambda cycles: held.append(cycles))
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    channel = ControlChannel(None, rank=1, stream_delay=gpu_delay.StreamDelay(torch.device("cuda", 0)))
    channel.delay = 0.5
    began = time.perf_counter()
    assert channel.spend_delay() == 0.5
    assert time.perf_counter() - began < 0.1  # the CPU went on: the GPU's stream holds the delay
    assert held == [500_000_000]
    cpu = ControlChannel(None, rank=1)
    cpu.delay = 0.05
    began = time.perf_counter()
    assert cpu.spend_delay() == 0.05 and time.perf_counter() - began >= 0.05  # a CPU rank computes it


def test_a_rank_calibrates_its_gpu_delay_once_for_every_run_and_the_link():
    import torch

    from labkit.rank.instruments.slow_link import LinkState

    link = LinkState()
    gpu = torch.device("cuda", 0)
    assert link.stream_delay(gpu) is link.stream_delay(gpu)  # no calibration per run or per collective
    assert link.stream_delay(gpu) is not link.stream_delay(torch.device("cuda", 1))
