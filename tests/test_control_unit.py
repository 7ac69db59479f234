"""The control channel between notebook and ranks, through a real file in tmp_path: no ranks.

The notebook side (``labkit.cluster.control.ControlRequests``) replaces a JSON
file; the rank side (``labkit.rank.control.ControlChannel``) re-reads it when its
modification time changed.
"""

import json
import math
import os
import time

import pytest

from labkit.cluster.control import SLOW_KEY, STOP_KEY, ControlRequests
from labkit.rank.control import ControlChannel
from labkit.spec.errors import LabConfigError

WORLD = 4


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "control.json")


def touch_later(path, stamp_before):
    """Make sure the file's mtime differs from ``stamp_before`` (coarse clocks can repeat it)."""
    if os.stat(path).st_mtime_ns == stamp_before:
        os.utime(path, ns=(stamp_before + 1_000_000, stamp_before + 1_000_000))


def write_raw(path, text, stamp_before=None):
    with open(path, "w") as handle:
        handle.write(text)
    if stamp_before is not None:
        touch_later(path, stamp_before)


# -- notebook side ----------------------------------------------------------------


def test_the_file_holds_stop_and_slowdowns_by_rank(path):
    requests = ControlRequests(path)
    requests.request_stop()
    requests.set_slowdown(2, 0.03, WORLD)
    assert json.load(open(path)) == {STOP_KEY: True, SLOW_KEY: {"2": 0.03}}
    requests.request_stop(False)
    assert json.load(open(path)) == {STOP_KEY: False, SLOW_KEY: {"2": 0.03}}


def test_a_write_leaves_no_partial_file_behind(path, tmp_path):
    requests = ControlRequests(path)
    requests.set_slowdown(1, 0.5, WORLD)
    requests.set_slowdown(3, 0.25, WORLD)
    assert sorted(os.listdir(tmp_path)) == ["control.json"]


def test_slowdown_messages_say_what_changed(path):
    requests = ControlRequests(path)
    assert requests.set_slowdown(1, 0.02, WORLD) == "rank 1 now takes 20 ms longer per training step"
    assert requests.set_slowdown(1, 2, WORLD) == "rank 1 now takes 2000 ms longer per training step"
    assert requests.slow == {1: 2.0} and isinstance(requests.slow[1], float)
    assert requests.set_slowdown(1, None, WORLD) == "rank 1 runs at its own speed again"


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_no_slowdown_removes_the_rank_from_the_file(path, off):
    requests = ControlRequests(path)
    requests.set_slowdown(0, 0.01, WORLD)
    requests.set_slowdown(3, 0.02, WORLD)
    requests.set_slowdown(0, off, WORLD)
    assert requests.slow == {3: 0.02}
    assert json.load(open(path))[SLOW_KEY] == {"3": 0.02}
    requests.set_slowdown(2, off, WORLD)  # a rank never slowed: nothing to remove, no error
    assert requests.slow == {3: 0.02}


@pytest.mark.parametrize("rank", [-1, WORLD, 99, True, False, "1", 1.0, None])
def test_a_bad_rank_is_refused_with_the_valid_range(path, rank):
    requests = ControlRequests(path)
    with pytest.raises(LabConfigError, match=r"rank must be between 0 and 3, got "):
        requests.set_slowdown(rank, 0.01, WORLD)
    assert requests.slow == {} and not os.path.exists(path)  # nothing written


@pytest.mark.parametrize("seconds", [-0.001, -1, math.inf, math.nan, True, False, "30ms", [0.1]])
def test_a_bad_delay_is_refused(path, seconds):
    requests = ControlRequests(path)
    requests.set_slowdown(1, 0.01, WORLD)
    with pytest.raises(LabConfigError, match="the delay must be a finite number of seconds >= 0, got "):
        requests.set_slowdown(1, seconds, WORLD)
    assert requests.slow == {1: 0.01}  # the earlier request stands
    assert json.load(open(path))[SLOW_KEY] == {"1": 0.01}


def test_the_last_rank_is_valid(path):
    ControlRequests(path).set_slowdown(WORLD - 1, 0.01, WORLD)
    assert json.load(open(path))[SLOW_KEY] == {str(WORLD - 1): 0.01}


def test_before_the_ranks_exist_writes_are_a_no_op(tmp_path):
    nowhere = ControlRequests(None)
    nowhere.request_stop()
    assert nowhere.set_slowdown(1, 0.01, WORLD).startswith("rank 1 now takes")
    assert nowhere.stop and nowhere.slow == {1: 0.01}  # remembered, for when there is a file

    missing_dir = tmp_path / "not-yet" / "control.json"
    later = ControlRequests(str(missing_dir))
    later.request_stop()
    later.set_slowdown(2, 0.5, WORLD)
    assert not (tmp_path / "not-yet").exists()
    (tmp_path / "not-yet").mkdir()
    later.write()  # once the directory exists, everything asked so far is written
    assert json.load(open(missing_dir)) == {STOP_KEY: True, SLOW_KEY: {"2": 0.5}}


# -- rank side --------------------------------------------------------------------


def test_round_trip_each_rank_reads_stop_and_only_its_own_delay(path):
    requests = ControlRequests(path)
    requests.set_slowdown(2, 0.04, WORLD)
    requests.request_stop()
    slowed, other = ControlChannel(path, 2), ControlChannel(path, 1)
    for channel in (slowed, other):
        channel.poll()
        assert channel.stop_requested is True
    assert slowed.delay == 0.04
    assert other.delay == 0.0


def test_no_file_means_no_requests(path):
    channel = ControlChannel(path, 0)
    channel.poll()
    assert channel.stop_requested is False and channel.delay == 0.0


def test_a_rank_picks_up_later_changes(path):
    requests = ControlRequests(path)
    requests.set_slowdown(0, 0.01, WORLD)
    channel = ControlChannel(path, 0)
    channel.poll()
    assert channel.delay == 0.01 and not channel.stop_requested

    stamp = os.stat(path).st_mtime_ns
    requests.set_slowdown(0, 0.02, WORLD)
    requests.request_stop()
    touch_later(path, stamp)
    channel.poll()
    assert channel.delay == 0.02 and channel.stop_requested

    stamp = os.stat(path).st_mtime_ns
    requests.set_slowdown(0, None, WORLD)
    requests.request_stop(False)
    touch_later(path, stamp)
    channel.poll()
    assert channel.delay == 0.0 and not channel.stop_requested


def test_a_rank_rereads_only_when_the_file_changed(path):
    ControlRequests(path).set_slowdown(1, 0.01, WORLD)
    channel = ControlChannel(path, 1)
    channel.poll()
    stamp = os.stat(path).st_mtime_ns
    # Rewrite the content but keep the modification time: an unchanged stamp means no read.
    write_raw(path, json.dumps({STOP_KEY: True, SLOW_KEY: {"1": 9.0}}))
    os.utime(path, ns=(stamp, stamp))
    channel.poll()
    assert channel.delay == 0.01 and channel.stop_requested is False
    # The same content with a new stamp is read.
    touch_later(path, stamp)
    channel.poll()
    assert channel.delay == 9.0 and channel.stop_requested is True


def test_a_removed_file_clears_the_requests(path):
    requests = ControlRequests(path)
    requests.request_stop()
    requests.set_slowdown(3, 0.5, WORLD)
    channel = ControlChannel(path, 3)
    channel.poll()
    assert channel.stop_requested and channel.delay == 0.5
    os.remove(path)
    channel.poll()
    assert not channel.stop_requested and channel.delay == 0.0


@pytest.mark.parametrize("partial", ["", '{"stop": tr', '{"stop": true, "slow": {"0": 0.'])
def test_a_half_written_file_leaves_the_previous_values(path, partial):
    requests = ControlRequests(path)
    requests.set_slowdown(0, 0.03, WORLD)
    channel = ControlChannel(path, 0)
    channel.poll()
    stamp = os.stat(path).st_mtime_ns
    write_raw(path, partial, stamp_before=stamp)
    channel.poll()
    assert channel.delay == 0.03 and channel.stop_requested is False


def test_after_a_half_written_file_the_complete_one_is_read(path):
    requests = ControlRequests(path)
    channel = ControlChannel(path, 0)
    requests.set_slowdown(0, 0.03, WORLD)
    channel.poll()
    stamp = os.stat(path).st_mtime_ns
    write_raw(path, '{"stop": tr', stamp_before=stamp)
    channel.poll()
    stamp = os.stat(path).st_mtime_ns
    write_raw(path, json.dumps({STOP_KEY: True, SLOW_KEY: {"0": 0.05}}), stamp_before=stamp)
    channel.poll()
    assert channel.stop_requested and channel.delay == 0.05


def test_a_half_written_file_is_read_again_at_the_next_step(path):
    ControlRequests(path).set_slowdown(0, 0.03, WORLD)
    channel = ControlChannel(path, 0)
    channel.poll()
    previous = os.stat(path).st_mtime_ns
    # A writer that is not atomic: the first half lands, the rank polls, the rest lands
    # within the same tick of the filesystem's clock (same mtime).
    write_raw(path, '{"stop": true, "slow": {"0"', stamp_before=previous)
    stamp = os.stat(path).st_mtime_ns
    channel.poll()
    write_raw(path, json.dumps({STOP_KEY: True, SLOW_KEY: {"0": 0.05}}))
    os.utime(path, ns=(stamp, stamp))
    channel.poll()  # the next step
    assert channel.stop_requested and channel.delay == 0.05


# -- spending the delay ----------------------------------------------------------------


def test_spend_delay_busy_waits_about_the_delay(path):
    ControlRequests(path).set_slowdown(1, 0.05, WORLD)
    channel = ControlChannel(path, 1)
    channel.poll()
    wall, cpu = time.perf_counter(), time.process_time()
    assert channel.spend_delay() == 0.05
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.05 <= wall < 0.5
    assert cpu >= 0.25 * wall  # a slow device computes: the time is spent busy, not asleep


def test_no_delay_returns_at_once(path):
    channel = ControlChannel(path, 0)
    channel.poll()
    began = time.perf_counter()
    assert channel.spend_delay() == 0.0
    assert time.perf_counter() - began < 0.01
