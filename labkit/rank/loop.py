"""The training loop every strategy shares, on CPU and GPU ranks alike.

``train(config)`` runs on every rank (``Lab.train`` sends it): build the model
(its declaration, ``zoo.catalog``) with the same seed everywhere, apply the
strategy (``strategies``), then
for each step take this rank's slice of the step's global batch, run forward and
backward, and let the optimizer update what this rank holds. Nothing in the loop
knows which strategy it runs; the ``ParallelModel`` does.

Between backward and the update the ranks agree whether every loss was finite
(``nonfinite``): a NaN or infinite loss stops the run before that step's update,
or skips it, as ``on_nonfinite`` says.

With ``verify``, every rank then retrains the model in plain single-process
PyTorch and compares (``verify.compare_with_reference``).

On a GPU the loop never makes the CPU wait for the device inside a step: the
batch is copied from the run's pinned buffers without blocking
(``host_staging``), the loss stays a device tensor until a progress line (or
the end) reads it, and step times come from CUDA events read later. So the
CPU prepares step n+1 while the GPU runs step n.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from labkit.rank.context import RankContext, ScriptContext  # noqa: F401 - ScriptContext: the benchmarks' way in
from labkit.rank.environment import device_name
from labkit.rank.instruments.run_instruments import instruments_for
from labkit.rank.instruments.step_timer import StepTimer
from labkit.rank.lab_traffic import control_tensor
from labkit.rank.memory import estimated_bytes, local_bytes, memory_bytes
from labkit.rank.nonfinite import LossWatch, NonFiniteGuard
from labkit.rank.own_model import trainable_for
from labkit.rank.periodic_checkpoints import PeriodicCheckpoints
from labkit.rank.state import state_for
from labkit.rank.torch_log_fold import torch_exceptions_folded
from labkit.spec.train_config import OPTIMIZERS, TrainConfig
from labkit.strategies.catalog import DATA_AXES, strategy
from labkit.strategies.compose import ParallelModel, shard_for_memory_estimate
from labkit.torch_support import batches
from labkit.torch_support.host_staging import PinnedStaging
from labkit.torch_support.optimizers import make_optimizer
from labkit.wire.current import this_rank
from labkit.wire.schema import MemoryBytes, RankResult


@contextlib.contextmanager
def precision_settings(config: TrainConfig) -> Iterator[None]:
    """TF32 matrix products for the run when asked (NVIDIA GPUs), restored afterwards."""
    if not config.tf32:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def batch_staging(device: torch.device) -> PinnedStaging | None:
    """The run's pinned buffers for its batches on a GPU; none on the host, where nothing is copied.

    Dropped when the run ends, maybe with its last copies still to run: torch's pinned
    allocator hands a block out again only once the copies made from it are done."""
    return PinnedStaging(device) if device.type == "cuda" else None


def to_device(batch, staging: PinnedStaging | None):
    """A batch on the rank's device: as it is on the host; to a GPU through the run's pinned buffers,
    without waiting (a copy from pageable memory makes the CPU wait for the GPU to reach it)."""
    return batch if staging is None else batches.to_device(batch, staging.to_device)


def _coordinate(mesh, config: TrainConfig) -> dict[str, int]:
    return {name: mesh.get_local_rank(name) for name in config.mesh_names}


class LossLog:
    """Every step's loss, and the progress lines, without making a GPU wait.

    A loss stays a device tensor until it is needed: reading it makes the CPU
    wait for the GPU. A progress line (every ``log_every`` steps, and the last)
    is printed once the *next* step has been enqueued, so the GPU has work while
    the CPU waits for the number. The line shows the loss averaged over dp
    replicas (a small all-reduce, outside the timed step).
    """

    def __init__(self, config: TrainConfig, mesh, parallel, recorder, reporter: bool, timer: StepTimer) -> None:
        self.config, self.mesh, self.parallel = config, mesh, parallel
        self.recorder, self.reporter, self.timer = recorder, reporter, timer
        self._values: list[float] = []
        self._unread: list = []
        self._due: int | None = None

    def add(self, step: int, loss) -> None:
        self._unread.append(loss)
        self.print_due()
        if step % self.config.log_every == 0 or step == self.config.steps - 1:
            self._due = step

    def values(self) -> list[float] | None:
        """Every step's loss as numbers (None on ranks that do not compute it)."""
        self.print_due()
        if not self.parallel.owns_loss:
            return None
        self._read(len(self._values) + len(self._unread))
        return self._values

    def _read(self, upto: int) -> None:
        """The losses of the steps before ``upto`` as numbers: one transfer, and the device tensors freed."""
        count = upto - len(self._values)
        if count > 0:
            self._values.extend(torch.stack([loss.float() for loss in self._unread[:count]]).tolist())
            del self._unread[:count]

    def print_due(self) -> None:
        step, self._due = self._due, None
        if step is None or not self.parallel.owns_loss:
            return
        config = self.config
        self._read(step + 1)
        loss = self._values[step]
        for group, size in self.parallel.loss_groups:  # the mean over the data-parallel replicas
            total = control_tensor([loss], dtype=torch.float64, group=group)
            self.recorder.paused = True  # this all-reduce is the lab's, not the model's
            try:
                dist.all_reduce(total, group=group)
            finally:
                self.recorder.paused = False
            loss = float(total) / size
        if self.reporter:
            seconds = self.timer.seconds_of(step)
            took = f"  {seconds * 1000:.1f} ms" if seconds is not None else ""
            first = config.first_step  # a continued run counts on from where the last one stopped
            print(f"step {first + step + 1:>4}/{first + config.steps}  loss {loss:.4f}{took}", flush=True)


def train(config: TrainConfig, context: RankContext | None = None) -> RankResult:
    runtime = context or this_rank()
    with precision_settings(config), torch_exceptions_folded():
        return _train(config, runtime)


def _reports(config: TrainConfig, parallel: ParallelModel, coordinate: dict[str, int]) -> bool:
    """Whether this rank prints the progress lines: among the ranks that compute the loss (a pipeline's
    last stage), the first data-parallel replica's first along every axis whose ranks share one loss."""
    shared = {strategy(part).axis for part in config.parts if not strategy(part).loss_on_one_rank}
    first_replica = parallel.data_share is not None and parallel.data_share[0] == 0
    return parallel.owns_loss and first_replica and all(
        index == 0 for name, index in coordinate.items() if name in shared and name not in DATA_AXES)


def _steps(config: TrainConfig, state, parallel: ParallelModel, optimizer, trainable, staging, timer: StepTimer,
           instruments, losses: LossLog, guard: NonFiniteGuard, watch: LossWatch | None, checkpoints, saved: list[str],
           samples: int, tokens: int | None) -> None:
    """The run's steps, until ``config.steps`` are done, a stop is agreed or the strategy has finished."""
    for step in range(config.steps):  # this run's steps; the data position is the state's
        if instruments.stop_agreed(step) or (parallel.finished is not None and parallel.finished()):
            break
        share = parallel.data_share  # a rank that takes no data (a parameter server's server) makes none
        batch = None
        if share is not None:
            position = (state.step, config.global_batch, *share) if parallel.batch_position is None \
                else parallel.batch_position(state.step)
            batch = to_device(trainable.share(*position), staging)
        timer.begin()
        delay = instruments.begin_step(state.step)  # rows count steps from the run's start, across continuations
        optimizer.zero_grad(set_to_none=True)
        loss = parallel.forward_backward(batch)
        gradients = [p.grad for p in parallel.module.parameters() if p.grad is not None] \
            if watch is not None and watch.poison else None
        if guard.check(state.step + 1, loss, watch, gradients) is None:
            state.updating = True
            parallel.optimizer_step(optimizer)
            state.updating = False
        elif guard.stops:  # every rank stops here: the model and optimizer stay as the last finite step left them
            optimizer.zero_grad(set_to_none=True)
            timer.abandon()
            break
        state.finish_step()
        timer.end()
        instruments.end_step(samples, tokens, loss, delay)
        losses.add(step, loss)
        if checkpoints is not None and config.checkpoint_every and state.step % config.checkpoint_every == 0:
            saved.append(checkpoints.save(state))


def _train(config: TrainConfig, runtime: RankContext) -> RankResult:
    device = runtime.device
    state = state_for(config, runtime, make_optimizer)
    parallel, optimizer, mesh = state.parallel, state.optimizer, state.mesh
    coordinate = _coordinate(mesh, config)
    trainable = state.trainable
    reporter = _reports(config, parallel, coordinate)
    recorder = runtime.recorder
    recorder.clear()  # rows and timeline describe this run only
    parallel.strategy_results.clear()  # and so do what the strategy measured
    instruments = instruments_for(config, runtime, parallel)
    timer = StepTimer(device)
    losses = LossLog(config, mesh, parallel, recorder, reporter, timer)
    samples = config.global_batch // config.data_parts if parallel.data_share is not None else 0
    tokens_per_sample = trainable.tokens_per_sample()
    tokens = samples * tokens_per_sample if tokens_per_sample is not None else None
    saved: list[str] = []  # checkpoints this run wrote
    staging = batch_staging(device)  # one per run: its buffers are reused by every step
    checkpoints = PeriodicCheckpoints(config) if config.checkpoint_every else None
    guard = NonFiniteGuard(config.on_nonfinite, parallel.lockstep, recorder)
    # One loss per step, made before its backward, on every rank: the agreement can run beside the backward.
    one_loss = parallel.forward is None and parallel.runner is None and parallel.micro_batches == 1
    # A pipeline's schedule also runs the loss on made-up outputs to infer shapes: its step's loss is read instead.
    # DDP alone on the host: the gradients, synced, are the same on every rank and carry a NaN loss's mark.
    replicated = tuple(config.parts) == ("ddp",) and device.type == "cpu" and parallel.forward is None
    watch = LossWatch(device, None if replicated or not one_loss else guard.send, poison=replicated) \
        if guard.agrees and parallel.runner is None else None
    trainable.loss_watch = watch  # the losses the loop's steps make, seen as they are made; not the reference's
    try:
        _steps(config, state, parallel, optimizer, trainable, staging, timer, instruments, losses, guard, watch,
               checkpoints, saved, samples, tokens)
    finally:
        trainable.loss_watch = None
    losses.print_due()
    instruments.finish()
    state.pause()
    step_seconds = timer.seconds()
    result: RankResult = {
        "rank": runtime.rank,
        "role": parallel.role,
        "coordinate": coordinate,
        "owns_loss": parallel.owns_loss,
        "first_step": config.first_step,
        "losses": losses.values(),
        "step_seconds": step_seconds,
        "steps_done": len(step_seconds),
        "memory": _typed(memory_bytes(parallel.module, optimizer, parallel.extra_state.values())),
        "rows": instruments.rows(),
        "timeline": instruments.timeline(),
        "device_name": device_name(device),
        "checkpoints": saved,
        "nonfinite": guard.found,
        "strategy_results": dict(parallel.strategy_results),
    }
    if config.verify:
        from labkit.rank.verify import compare_with_reference

        result["verify"] = compare_with_reference(config, parallel, device, state.step, trainable)
    return result


def estimate_memory(config: TrainConfig) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer bytes under ``config``, from a meta-device model
    (``MemoryBytes``'s keys)."""
    runtime = this_rank()
    mesh = runtime.mesh_for(config.mesh_shape, config.mesh_names, instrumented=config.instruments)
    trainable = trainable_for(config, runtime)
    network = trainable.build(config.seed, "meta")
    shard_for_memory_estimate(network, mesh, config, runtime.backend, trainable)
    param_bytes = sum(local_bytes(p) for p in {id(p): p for p in network.parameters()}.values())
    # A strategy may keep copies of the parameters beside the optimizer's state (DiLoCo: two).
    copies = sum(strategy(part).state_copies for part in config.parts)
    return estimated_bytes(param_bytes, OPTIMIZERS[config.optimizer] + copies)


def _typed(memory: dict[str, int]) -> MemoryBytes:
    return MemoryBytes(params=memory["params"], grads=memory["grads"], optimizer=memory["optimizer"])
