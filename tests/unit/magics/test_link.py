"""The simulated slow link without ranks: units, the cost model, the notebook's checks, the rank's wire."""

import time

import pytest
from IPython.core.error import UsageError

from labkit.magics.link import link_command, parse_words
from labkit.runs.link import describe, set_link, waiting_notice
from labkit.runs.status import LabStatus
from labkit.spec.errors import LabConfigError
from labkit.spec.link import LinkSpec, rounds_and_wire_bytes
from labkit.units import format_bandwidth, format_seconds, parse_bandwidth, parse_latency


# -- units ------------------------------------------------------------------------

@pytest.mark.parametrize("text, bits", [
    ("100Mbit", 1e8), ("1Gbit", 1e9), ("100 Mbit/s", 1e8), ("500kbit", 5e5), ("100Mbps", 1e8), ("1Gb/s", 1e9),
    ("2.5 Gbits/s", 2.5e9), ("10MB/s", 8e7), ("10 MBps", 8e7), ("1MiB/s", 8 * 2**20), ("64kbit", 64e3),
])
def test_bandwidth_is_bits_per_second_with_decimal_prefixes_or_bytes_with_a_capital_b(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text, says", [
    ("fast", "with its unit"), ("20", "with its unit"), ("100M", "with its unit"), (100e6, "with its unit"),
    ("0Mbit", "above zero"), ("-5Mbit", "above zero"), ("0 MB/s", "above zero"),
])
def test_unreadable_zero_or_negative_bandwidth_is_refused_saying_what_to_write(text, says):
    with pytest.raises(ValueError, match=says) as refused:
        parse_bandwidth(text)
    assert "100Mbit" in str(refused.value)


@pytest.mark.parametrize("text, seconds", [("20ms", 0.02), ("0.5s", 0.5), ("250us", 250e-6), ("250µs", 250e-6),
                                           ("20 ms", 0.02), ("0ms", 0.0), (0.02, 0.02)])
def test_latency_needs_its_unit_in_text(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["20", "fast", "-5ms", "20 Mbit", float("inf"), -1, True, None])
def test_a_latency_without_unit_or_below_zero_is_refused(text):
    with pytest.raises(ValueError, match="20ms"):
        parse_latency(text)


def test_link_units_are_written_back_as_networks_write_them():
    assert format_bandwidth(1e8) == "100 Mbit/s" and format_bandwidth(8e7) == "80 Mbit/s"
    assert format_bandwidth(2.5e9) == "2.5 Gbit/s" and format_bandwidth(5e5) == "500 kbit/s"
    assert format_seconds(0.02) == "20 ms" and format_seconds(250e-6) == "250 µs" and format_seconds(1.5) == "1.5 s"


# -- the model ----------------------------------------------------------------------

def test_rounds_and_bytes_follow_ring_tree_and_point_to_point_algorithms():
    buffer = 1_000_000
    assert rounds_and_wire_bytes("all_reduce", buffer, 4) == (6, 1_500_000)  # 2(n-1), 2(n-1)/n B
    assert rounds_and_wire_bytes("all_gather", buffer, 4) == (3, 750_000)  # n-1, (n-1)/n B
    assert rounds_and_wire_bytes("reduce_scatter", buffer, 4) == (3, 750_000)
    assert rounds_and_wire_bytes("all_to_all", buffer, 2) == (1, 500_000)
    assert rounds_and_wire_bytes("broadcast", buffer, 4) == (2, 2_000_000)  # binomial tree: ceil(log2 n)
    assert rounds_and_wire_bytes("broadcast", buffer, 5) == (3, 3_000_000)
    assert rounds_and_wire_bytes("barrier", 0, 8) == (3, 0)
    assert rounds_and_wire_bytes("send", buffer, 4) == (1, buffer) == rounds_and_wire_bytes("recv", buffer, 2)
    assert rounds_and_wire_bytes("all_reduce", buffer, 1) == (0, 0)  # one rank crosses no link
    with pytest.raises(ValueError, match="no collective"):
        rounds_and_wire_bytes("gossip", buffer, 4)


def test_a_collective_costs_latency_per_round_plus_its_bytes_over_the_bandwidth():
    link = LinkSpec.parse("100Mbit", "20ms")
    # 6 rounds x 20 ms + 1.5 MB x 8 / 100 Mbit/s = 0.12 s + 0.12 s
    assert link.seconds("all_reduce", 1_000_000, 4) == pytest.approx(0.24)
    assert link.seconds("send", 1_000_000, 2) == pytest.approx(0.02 + 0.08)
    assert LinkSpec.parse(latency="50ms").seconds("all_reduce", 4, 4) == pytest.approx(0.3)
    assert LinkSpec.parse("10MB/s").seconds("all_gather", 4_000_000, 4) == pytest.approx(0.3)
    assert "240 ms longer" in link.example(4)


def test_off_and_partial_settings():
    for off in [("off",), (None,), ("none", None), (None, "off"), ("off", "0ms")]:
        assert LinkSpec.parse(*off) is None
    assert LinkSpec.parse(latency="50ms") == LinkSpec(None, 0.05)
    assert LinkSpec.parse("1Gbit") == LinkSpec(1e9, 0.0)
    assert str(LinkSpec.parse("100Mbit", "20ms")) == "simulated link: 100 Mbit/s, 20 ms latency"
    with pytest.raises(LabConfigError, match="lab.link\\(bandwidth='100Mbit', latency='20ms'\\)"):
        LinkSpec.parse("fast", "20ms")


# -- the notebook side ---------------------------------------------------------------

class _Session:
    """Just what ``set_link`` uses of a session, noting what would reach the ranks."""

    def __init__(self, running=True):
        self.running, self.world_size, self.start_timeout = running, 4, 60.0
        self.link, self.sent = None, []

    def ready(self):
        self.sent.append("ready")

    def call(self, ranks, work_entry, args, timeout):
        self.sent.append((list(ranks), work_entry.__name__, args))


def test_set_link_checks_first_then_gives_every_rank_the_setting(capsys):
    session = _Session()
    spec = set_link(session, "100Mbit", "20ms")
    assert session.link == spec == LinkSpec(1e8, 0.02)
    assert session.sent == ["ready", ([0, 1, 2, 3], "set_link", (spec,))]
    assert set_link(session) is spec  # nothing given: the link in place, nothing sent
    assert len(session.sent) == 2
    assert capsys.readouterr().out == ""  # a link set is shown by what it returns
    assert set_link(session, "off") is None and session.sent[-1][2] == (None,)
    assert capsys.readouterr().out.splitlines() == [
        "simulated link removed: collectives run at this machine's speed again"]
    assert set_link(session, "off") is None
    assert capsys.readouterr().out.splitlines() == ["no simulated link was set: nothing to remove"]


def test_a_wait_over_the_link_is_named_once_it_lasts():
    import threading

    said, shown = [], threading.Event()

    def say(text):
        said.append(text)
        shown.set()

    link = LinkSpec(1e8, 0.02)
    with waiting_notice(link, "check their new process group", after=0.0, say=say):
        assert shown.wait(30)  # the block is still running when the notice comes
    assert said == ["waiting for the ranks to check their new process group over the simulated link "
                    "(100 Mbit/s, 20 ms latency) ..."]
    with waiting_notice(link, "check their new process group", after=3600, say=say):
        pass  # done before the notice was due: nothing said
    with waiting_notice(None, "check their new process group", after=0.0, say=say):
        pass  # no link: nothing to say
    assert len(said) == 1


@pytest.mark.parametrize("setting", [("fast",), ("-5Mbit", "20ms"), ("0Mbit",), ("100Mbit", "20"), (..., "20")])
def test_bad_input_is_refused_before_anything_is_sent(setting):
    session = _Session()
    session.link = LinkSpec(1e9, 0.001)
    with pytest.raises(LabConfigError):
        set_link(session, *setting)
    assert session.sent == [] and session.link == LinkSpec(1e9, 0.001)


@pytest.mark.parametrize("setting", [("1bit",), (None, "3s"), ("10bit", "1s")])
def test_a_link_too_slow_for_the_lab_to_heal_over_is_refused(setting):
    session = _Session()  # 4 ranks, start_timeout 60 s: the group check may take 15 s at most
    with pytest.raises(LabConfigError, match="too slow for this lab.*start_timeout"):
        set_link(session, *setting)
    assert session.sent == [] and session.link is None
    assert set_link(session, "1Mbit", "1s") == LinkSpec(1e6, 1.0)  # 6 s for the check: allowed


def test_a_stopped_lab_keeps_the_setting_for_its_next_start():
    session = _Session(running=False)
    assert set_link(session, latency="5ms") == LinkSpec(None, 0.005) == session.link
    assert session.sent == []


def test_magic_words():
    assert parse_words([]) == (..., ...)
    assert parse_words(["off"]) == (None, None)
    assert parse_words(["100Mbit", "20ms"]) == ("100Mbit", "20ms")
    assert parse_words(["20ms", "1Gbit"]) == ("1Gbit", "20ms")
    assert parse_words(["100", "Mbit/s", "20", "ms"]) == ("100Mbit/s", "20ms")
    assert parse_words(["250us"]) == (None, "250us")
    with pytest.raises(LabConfigError, match="'20' needs its unit, e.g. 20ms"):
        parse_words(["100Mbit", "20"])
    with pytest.raises(LabConfigError, match="at most one bandwidth"):
        parse_words(["100Mbit", "1Gbit"])


class _Lab:
    world_size = 4

    def __init__(self):
        self.session = _Session()

    def link(self, bandwidth=..., latency=...):
        return set_link(self.session, bandwidth, latency)


def test_link_command_says_what_the_link_does(capsys):
    lab = _Lab()
    link_command(lab, ["100Mbit", "20ms"])
    assert capsys.readouterr().out.strip() == ("simulated link: 100 Mbit/s, 20 ms latency; an all-reduce of "
                                               "1.0 MB over 4 ranks takes 240 ms longer")
    link_command(lab, [])
    assert "100 Mbit/s" in capsys.readouterr().out
    link_command(lab, ["off"])
    assert capsys.readouterr().out.splitlines() == [
        "simulated link removed: collectives run at this machine's speed again"]
    link_command(lab, ["off"])
    assert capsys.readouterr().out.splitlines() == ["no simulated link was set: nothing to remove"]
    link_command(lab, [])
    assert capsys.readouterr().out.splitlines() == ["no simulated link: collectives run at this machine's speed"]
    with pytest.raises(UsageError, match="%lab link: write the bandwidth with its unit"):
        link_command(lab, ["fast"])
    assert describe(None, 4).startswith("no simulated link")


def test_status_headline_names_the_link():
    status = LabStatus("4 ranks", running=True, generation=1, timeout=30.0, link="100 Mbit/s, 20 ms latency")
    assert "simulated link 100 Mbit/s, 20 ms latency" in status.headline()
    assert "simulated link" not in LabStatus("4 ranks", running=True, generation=1, timeout=30.0).headline()


# -- the rank side, with torch futures and no process group -----------------------------------------------

class _DoneWork:
    """A collective's work that already completed (or failed), as the real group would hand it back."""

    def __init__(self, error=None):
        import torch

        self.future = torch.futures.Future()
        if error is None:
            self.future.set_result([torch.ones(2)])
        else:
            self.future.set_exception(error)

    def get_future(self):
        return self.future


class _Recorder:
    watches_waits = False

    def __init__(self):
        self.done = []

    def completed(self, kind, nbytes, token):
        self.done.append((kind, time.perf_counter()))

    def waiting(self):
        import contextlib

        return contextlib.nullcontext()


def test_the_wire_completes_collectives_one_after_another_and_after_their_time():
    from labkit.rank.instruments.slow_link import LinkState

    link, recorder = LinkState(), _Recorder()
    link.spec = LinkSpec(None, 0.01)  # 6 rounds on 4 ranks: 60 ms per all-reduce
    began = time.perf_counter()
    works = [link.slow(_DoneWork(), "all_reduce", 8, 4, recorder, None, None) for _ in range(3)]
    assert not any(work.is_completed() for work in works)  # issued without blocking
    works[-1].wait()
    took = time.perf_counter() - began
    assert took >= 3 * 0.06  # carried one after another, not side by side
    assert all(work.is_completed() for work in works)
    assert works[0].get_future().value()[0].tolist() == [1.0, 1.0]  # the real result comes through
    time.sleep(0.01)  # completion callbacks run just after the waiters wake
    times = [when - began for _, when in recorder.done]
    assert len(times) == 3 and times[0] >= 0.06 and times[1] >= 0.12 and times[2] >= 0.18


def test_a_failed_collective_fails_at_once_and_no_link_means_the_fast_path():
    from labkit.rank.instruments.slow_link import LinkState

    link, recorder = LinkState(), _Recorder()
    link.spec = LinkSpec(None, 10.0)
    work = link.slow(_DoneWork(RuntimeError("Connection closed by peer")), "all_reduce", 8, 4, recorder, None, None)
    began = time.perf_counter()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        work.wait()
    assert time.perf_counter() - began < 5  # not the link's 60 s
    assert link.slow(_DoneWork(), "all_reduce", 8, 1, recorder, None, None) is None  # one rank: nothing to cross
    link.spec = None
    assert link.slow(_DoneWork(), "all_reduce", 8, 4, recorder, None, None) is None
