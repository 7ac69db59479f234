"""The lab's start does only what the first cell needs; the imports a later rank needs come after,
while the ranks are idle (the process host's warmer).

Unit tests drive ``IdleWarmer`` with a made-up CPU clock; the integration test watches a real lab.
"""

import sys

import pytest

from labkit import Lab
from labkit.cluster.hosted.process_host import WARM_MODULES
from labkit.cluster.hosted.warmer import IdleWarmer
from tests.conftest import stop_leaving_nothing

CHEAP_MODULES = ("colorsys", "wave")  # stand-ins for the heavy ones: the test cares about when, not what


class FakeClock:
    """CPU seconds the ranks have used, advanced by the test."""

    def __init__(self) -> None:
        self.used = 0.0

    def __call__(self, pids) -> float:
        return self.used


def ticks(warmer, clock, start: float, end: float, busy_share: float, step: float = 0.1) -> list:
    """Tick every ``step`` seconds from ``start`` to ``end`` with the ranks using ``busy_share`` of a core."""
    imported, now = [], start
    while now < end - 1e-9:
        now += step
        clock.used += busy_share * step
        name = warmer.tick([1, 2], now)
        if name:
            imported.append((round(now, 2), name))
    return imported


def test_nothing_is_imported_before_the_request():
    warmer = IdleWarmer(CHEAP_MODULES, cpu_seconds=FakeClock())
    assert warmer.tick([1], 100.0) is None and not warmer.done


def test_busy_ranks_delay_the_imports_until_the_deadline():
    clock = FakeClock()
    warmer = IdleWarmer(CHEAP_MODULES, quiet_seconds=0.3, busy_share=0.1, force_after=5.0, cpu_seconds=clock)
    warmer.request(now=0.0)
    assert ticks(warmer, clock, 0.0, 4.9, busy_share=1.5) == []  # the ranks use 1.5 cores: wait
    late = ticks(warmer, clock, 4.9, 6.0, busy_share=1.5)
    assert [name for _, name in late] == list(CHEAP_MODULES) and all(when >= 5.0 for when, _ in late)
    assert warmer.done


def test_idle_ranks_let_the_imports_go_one_quiet_spell_each():
    clock = FakeClock()
    warmer = IdleWarmer(CHEAP_MODULES, quiet_seconds=0.3, busy_share=0.1, force_after=60.0, cpu_seconds=clock)
    warmer.request(now=0.0)
    imported = ticks(warmer, clock, 0.0, 2.0, busy_share=0.01)
    assert [name for _, name in imported] == list(CHEAP_MODULES)
    first, second = (when for when, _ in imported)
    assert 0.3 <= first < 0.6 and second - first >= 0.3  # each waits for its own quiet spell
    assert all(name in sys.modules for name in CHEAP_MODULES)


def test_a_burst_of_work_restarts_the_quiet_spell():
    clock = FakeClock()
    warmer = IdleWarmer(CHEAP_MODULES[:1], quiet_seconds=0.3, busy_share=0.1, force_after=60.0, cpu_seconds=clock)
    warmer.request(now=0.0)
    assert ticks(warmer, clock, 0.0, 0.2, busy_share=0.0) == []
    assert ticks(warmer, clock, 0.2, 0.3, busy_share=2.0) == []  # a cell ran: not quiet any more
    assert ticks(warmer, clock, 0.3, 0.5, busy_share=0.0) == []
    assert [name for _, name in ticks(warmer, clock, 0.5, 0.8, busy_share=0.0)] == list(CHEAP_MODULES[:1])


@pytest.mark.lab
def test_start_leaves_warm_imports_for_later_and_a_replaced_rank_gets_them():
    """Also: the engines of a start are numbered as their ranks."""
    lab = Lab(ranks=2, backend="gloo", threads_per_rank=1, timeout=60).start()
    try:
        probe = "import sys\n(sorted(m for m in {!r} if m in sys.modules), 'torch.distributed.tensor' in sys.modules)"
        # The ranks formed their group without importing DTensor (nothing of it was cached to clear)
        # and were forked before the host's warm imports.
        assert lab.run_cell(probe.format(WARM_MODULES), live=False) == [repr(([], False))] * 2
        # Engines started together ask for their rank as engine id: status reads alike in both columns.
        assert lab.cluster.engine_of == {0: 0, 1: 1}
        rows = [line.split() for line in str(lab.status()).splitlines()[2:]]
        assert [(row[0], row[4]) for row in rows] == [("0", "0"), ("1", "1")]
        lab.cluster.host.warmed.result(30)  # the idle lab lets the host warm up
        lab.kill(1)
        lab.heal()
        shown = lab.run_cell(probe.format(WARM_MODULES), ranks=[1], live=False)
        assert shown == [repr((sorted(WARM_MODULES), True))]
    finally:
        stop_leaving_nothing(lab)
