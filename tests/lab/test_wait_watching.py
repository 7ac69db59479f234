"""The GPU instruments' plumbing, exercised on 4 real gloo ranks.

On a GPU, every timed process group hands out its own ``TimedWork`` for every
collective (so a wait of the compute stream can be bracketed), and the loop
hooks the end of backward and FSDP's pre-forward. Whether torch's C++ callers
accept that (DDP's reducer takes the work's future, DTensor's functional
collectives and FSDP call ``wait``, the pipeline waits on sends and receives)
does not depend on the device: here a CPU recorder that asks for the same
treatment (``watches_waits``) runs every strategy, which must still train
exactly as one process does, with the waits and backward ends seen.
"""

import ast

import pytest

pytestmark = pytest.mark.lab

SMALL_GPT = dict(dim=32, heads=4, layers=4, seq=16, vocab=32)

WATCHED_RUN = '''
import contextlib

from torch.distributed.fsdp import FSDPModule

from labkit.rank.instruments.gpu_recorder import calling_at_backward_end
from labkit.rank.instruments.recorder import StepRecorder
from labkit.rank.loop import train
from labkit.spec.train_config import resolve


class WaitWatchingRecorder(StepRecorder):
    """CPU clocks, but every work wrapped and every wait and backward end noted, as on a GPU."""

    watches_waits = True

    def __init__(self, rank):
        super().__init__(rank)
        self.waits = self.backward_ends = self.fsdp_modules = 0

    def waiting(self):
        self.waits += 1
        return contextlib.nullcontext()

    def backward_watch(self, loss):
        return calling_at_backward_end(loss, self._backward_ended)

    def _backward_ended(self):
        self.backward_ends += 1

    def watch_module_waits(self, module):
        self.fsdp_modules += sum(isinstance(m, FSDPModule) for m in module.modules())


def timed_groups():
    from torch.distributed import distributed_c10d as c10d

    from labkit.rank.instruments.timed_group import TimedGroup

    return [group for group in list(c10d._world.pg_map) if isinstance(group, TimedGroup)]


runtime = __labkit__
config = resolve(world_size, strategy=STRATEGY, model=MODEL, mesh=MESH, steps=3, global_batch=16,
                 verify=True, model_settings=SETTINGS, log_every=100)
runtime.mesh_for(config.mesh_shape, config.mesh_names)  # built (or reused) and timed as usual
kept_recorder = runtime.recorder
watching = runtime.recorder = WaitWatchingRecorder(rank)
for group in timed_groups():  # every timed group now reports to the watching recorder
    group.recorder = watching
try:
    result = train(config)
finally:
    runtime.recorder = kept_recorder
    for group in timed_groups():
        group.recorder = kept_recorder
verdict = result["verify"]
(verdict["max_relative_difference"] < verdict["bound"], watching.waits, watching.backward_ends,
 watching.fsdp_modules, len(result["rows"]))
'''

CASES = [
    # strategy, model, mesh, a wait must be seen, backward ends are hooked
    ("ddp", "mlp", None, False, True),  # DDP's reducer takes the wrapped work's future
    ("fsdp", "gpt", None, True, True),
    ("tp", "gpt", None, True, True),  # DTensor's functional collectives wait on the wrapped work
    ("pp", "gpt", None, True, False),  # sends and receives; the schedule runs its own backward
    ("ddp+tp", "gpt", dict(dp=2, tp=2), True, True),  # the hand-written gradient all-reduce
]


@pytest.mark.parametrize("strategy, model, mesh, waits, hooked", CASES, ids=[case[0] for case in CASES])
def test_every_work_wrapped_still_trains_exactly(lab, strategy, model, mesh, waits, hooked):
    code = f"STRATEGY, MODEL, MESH, SETTINGS = {strategy!r}, {model!r}, {mesh!r}, {SMALL_GPT if model == 'gpt' else {}!r}\n"
    results = [ast.literal_eval(shown) for shown in lab.run_cell(code + WATCHED_RUN)]
    for rank, (equal, seen_waits, backward_ends, fsdp_modules, rows) in enumerate(results):
        assert equal, f"rank {rank}: not equal to single-process training with every work wrapped"
        assert rows == 3
        if waits:
            assert seen_waits > 0, f"rank {rank}: no wait was bracketed under {strategy}"
        if hooked:
            assert backward_ends == 3, f"rank {rank}: the end-of-backward hook ran {backward_ends} times in 3 steps"
        assert (fsdp_modules > 0) == (strategy == "fsdp")
