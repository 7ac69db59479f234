"""Imports the process host makes for later ranks, only while the lab's ranks leave the CPU free.

A rank that replaces a dead one is forked from the process host, so whatever the host
has imported it starts with. The modules a rank needs for its first training run or
checkpoint cost about 1.5 s of CPU; the host imports them once the lab is ready, so a
heal does not pay them again. But a lab is at its busiest just after it starts (the
user's first cells), and on a machine of two cores 1.5 s of imports beside four ranks
is time taken from them. So the host imports one module at a time, only once the
ranks' engines have used almost no CPU for a moment; if they never pause, it imports
the rest after ``force_after`` seconds anyway, so a heal long after the start is warm.
"""

from __future__ import annotations

import time

import psutil

QUIET_SECONDS = 0.3  # the ranks idle this long before the host imports a module
BUSY_SHARE = 0.1  # of one core, all ranks together: below it they count as idle
FORCE_AFTER_SECONDS = 5.0  # after the request, import whatever is left even if the ranks are busy


class IdleWarmer:
    """Imports ``modules`` one by one when the processes it is shown are idle (or after a while)."""

    def __init__(self, modules, quiet_seconds: float = QUIET_SECONDS, busy_share: float = BUSY_SHARE,
                 force_after: float = FORCE_AFTER_SECONDS, cpu_seconds=None) -> None:
        self.modules = tuple(modules)
        self.cpu_seconds = cpu_seconds or ProcessClock()  # pids -> the CPU seconds they have used
        self.quiet_seconds = quiet_seconds
        self.busy_share = busy_share
        self.force_after = force_after
        self.pending: list[str] = []
        self.requested_at: float | None = None
        self.quiet_since: float | None = None
        self._last: tuple[float, float] | None = None  # (when, the processes' CPU seconds then)

    @property
    def done(self) -> bool:
        return self.requested_at is not None and not self.pending

    def request(self, now: float | None = None) -> None:
        """Start warming (a second request changes nothing)."""
        if self.requested_at is None:
            self.requested_at = time.monotonic() if now is None else now
            self.pending = list(self.modules)

    def tick(self, pids, now: float | None = None) -> str | None:
        """Called while the host has nothing else to do: import the next module if it is time.

        Returns the module imported, if any."""
        if not self.pending:
            return None
        assert self.requested_at is not None  # modules are pending only once requested
        now = time.monotonic() if now is None else now
        self._observe(pids, now)
        forced = now - self.requested_at >= self.force_after
        quiet = self.quiet_since is not None and now - self.quiet_since >= self.quiet_seconds
        if not (forced or quiet):
            return None
        name = self.pending.pop(0)
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a rank imports what it needs anyway
            pass
        # The ranks may have woken meanwhile: the next module waits for a fresh quiet spell.
        self._last = None
        self.quiet_since = None
        return name

    def _observe(self, pids, now: float) -> None:
        cpu = self.cpu_seconds(pids)
        last, self._last = self._last, (now, cpu)
        if last is None or now <= last[0]:
            return
        share = (cpu - last[1]) / (now - last[0])
        if share < self.busy_share:
            self.quiet_since = self.quiet_since if self.quiet_since is not None else last[0]
        else:
            self.quiet_since = None


class ProcessClock:
    """The CPU seconds (user and system) that a set of processes has used, read from the system."""

    def __init__(self) -> None:
        self._processes: dict[int, psutil.Process] = {}

    def __call__(self, pids) -> float:
        pids = set(pids)
        for pid in list(self._processes):
            if pid not in pids:
                del self._processes[pid]
        total = 0.0
        for pid in pids:
            try:
                process = self._processes.get(pid) or self._processes.setdefault(pid, psutil.Process(pid))
                times = process.cpu_times()
            except psutil.Error:  # ended: it uses no more CPU
                self._processes.pop(pid, None)
                continue
            total += times.user + times.system
        return total
