"""A TimedGroup while the real group's call has not answered (no ranks: a gloo group of one process).

torch's collective checker (check_collectives) holds the call until every member made it: meanwhile the
operation must be in flight and waited for, or the notebook cannot name a member that never comes.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from labkit.rank.instruments.recorder import StepRecorder
from labkit.rank.instruments.timed_group import TimedGroup
from labkit.torch_support import torch_internals


class _HeldCall:
    """Stands for the real group: notes what the TimedGroup says during the call, then answers."""

    def __init__(self, real, timed_group) -> None:
        self.real = real
        self.timed_group = timed_group
        self.seen: list = []

    def allreduce(self, tensors, *args, **kwargs):
        self.seen.append((self.timed_group.pending(), self.timed_group.waiting, self.timed_group.entering))
        return self.real.allreduce(tensors, *args, **kwargs)


def test_an_operation_whose_call_has_not_answered_is_in_flight_and_waited_for():
    real = torch_internals.new_backend_group(1, 0, [], "gloo", dist.HashStore(), "held",
                                             timeout=timedelta(seconds=10))
    recorder = StepRecorder(rank=0)
    timed = TimedGroup(real, recorder)
    held = _HeldCall(real, timed)
    timed.inner = held  # type: ignore[assignment]
    try:
        timed.allreduce([torch.ones(4)]).wait()
        [(pending, waiting, entering)] = held.seen
        assert [(sequence, kind, nbytes) for sequence, kind, nbytes, _ in pending] == [(1, "all_reduce", 16)]
        assert waiting == entering == 1
        assert timed.pending() == [] and timed.waiting is None and timed.entering is None
    finally:
        recorder.clock.close()


def test_under_torchs_collective_checker_the_stand_in_registers_gloo_itself():
    # torch's C++ (DDP's constructor) casts a group's gloo backend to gloo: the checker read as gloo crashed
    # every rank. The checked group stays inside, and every operation goes through it.
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        real = torch_internals.new_backend_group(1, 0, [], "gloo", dist.HashStore(), "checked",
                                                 timeout=timedelta(seconds=10))
    finally:
        dist.set_debug_level(before)
    assert not isinstance(torch_internals.backend_of(real, torch.device("cpu")), dist.ProcessGroupGloo)  # the checker
    recorder = StepRecorder(rank=0)
    try:
        timed = TimedGroup(real, recorder)
        assert isinstance(torch_internals.backend_of(timed, torch.device("cpu")), dist.ProcessGroupGloo)
        assert timed.inner is real
    finally:
        recorder.clock.close()
