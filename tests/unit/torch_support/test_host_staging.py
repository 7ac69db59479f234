"""Batches reach a GPU through reused pinned buffers: the zoo's batches are contiguous, and the
staging's logic (reuse, growth, contiguous copies, the wait before a buffer is overwritten) runs on
the CPU with a stand-in allocator and fence (a CPU build of torch cannot pin). No processes; the
last test needs a CUDA GPU and is skipped without one."""

import pytest
import torch

from labkit.rank.loop import batch_staging, to_device
from labkit.torch_support.host_staging import PinnedStaging
from labkit.zoo.configs import GPTConfig, MLPConfig
from labkit.zoo.data import dataset_for


@pytest.mark.parametrize("vocab, seq, size, step", [(64, 32, 32, 0), (17, 5, 3, 9), (128, 64, 1, 2), (8, 1, 4, 0)])
def test_every_gpt_batch_is_contiguous_and_shifted_by_one(vocab, seq, size, step):
    inputs, targets = dataset_for("gpt", GPTConfig(vocab=vocab, seq=seq), seed=3).batch(step, size)
    assert inputs.shape == targets.shape == (size, seq)
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("dims, size", [((128, 512, 512, 512, 128), 32), ((1, 4, 1), 5), ((7, 3), 1)])
def test_every_mlp_batch_is_contiguous(dims, size):
    inputs, targets = dataset_for("mlp", MLPConfig(dims=dims), seed=1).batch(4, size)
    assert inputs.shape == (size, dims[0]) and targets.shape == (size, dims[-1])
    assert inputs.is_contiguous() and targets.is_contiguous()


class Host:
    """Stand-ins for pinned memory and CUDA events, with a log of what the staging did to them.

    Buffer n and fence n are made together (a buffer, then its fence), so a fence knows its
    buffer: at each wait it keeps what the buffer held, to show the wait came before any overwrite."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.fences: list[Fence] = []
        self.log: list[tuple[str, int]] = []

    def allocate(self, numel, dtype):
        self.buffers.append(torch.full((numel,), -1, dtype=dtype))
        return self.buffers[-1]

    def fence(self):
        self.fences.append(Fence(self, len(self.fences)))
        return self.fences[-1]


class Fence:
    def __init__(self, host: Host, index: int) -> None:
        self.host, self.index = host, index
        self.held_at_wait: list[torch.Tensor] = []

    def record(self) -> None:
        self.host.log.append(("record", self.index))

    def wait(self) -> None:
        self.host.log.append(("wait", self.index))
        self.held_at_wait.append(self.host.buffers[self.index].clone())


def staging(slots=2):
    host = Host()
    return PinnedStaging(torch.device("cpu"), slots=slots, allocate=host.allocate, fence=host.fence), host


def gpt_batch(step, size=4, seq=6):
    tokens = torch.arange(step * 1000, step * 1000 + size * (seq + 1)).view(size, seq + 1)
    return tokens[:, :-1], tokens[:, 1:]  # views, as the zoo's batches once were


def test_a_strided_batch_comes_out_equal_contiguous_and_from_the_buffer():
    stage, host = staging()
    inputs, targets = gpt_batch(1)
    assert not inputs.is_contiguous()
    out_inputs, out_targets = stage.to_device((inputs, targets))
    assert torch.equal(out_inputs, inputs) and torch.equal(out_targets, targets)
    assert out_inputs.is_contiguous() and out_targets.is_contiguous()
    # One buffer for the batch's one dtype; on the stand-in "device" the copies are views of it.
    (buffer,) = host.buffers
    assert buffer.numel() == inputs.numel() + targets.numel()
    assert out_inputs.data_ptr() == buffer.data_ptr()
    assert out_targets.data_ptr() == buffer.data_ptr() + inputs.numel() * buffer.element_size()


def test_the_same_buffers_serve_every_step_one_per_slot():
    stage, host = staging(slots=2)
    pointers = []
    for step in range(6):
        stage.to_device(gpt_batch(step))
        pointers.append(stage.buffers(step % 2)[torch.long].tensor.data_ptr())
    assert len(host.buffers) == 2  # two slots, one dtype: two allocations for the whole run
    assert pointers[0::2] == [pointers[0]] * 3 and pointers[1::2] == [pointers[1]] * 3
    assert pointers[0] != pointers[1]


def test_each_dtype_has_its_own_buffer():
    stage, host = staging(slots=1)
    floats, longs = torch.randn(3, 4).t(), torch.arange(5)
    out_floats, out_longs = stage.to_device((floats, longs))
    assert torch.equal(out_floats, floats) and torch.equal(out_longs, longs)
    assert set(stage.buffers(0)) == {torch.float32, torch.long}
    assert sorted(buffer.numel() for buffer in host.buffers) == [5, 12]


def test_a_larger_batch_grows_the_buffer_after_waiting_for_the_old_ones_copies():
    stage, host = staging(slots=1)
    stage.to_device(gpt_batch(0, size=2))
    small = host.buffers[0]
    out = stage.to_device(gpt_batch(1, size=8))
    assert len(host.buffers) == 2 and host.buffers[1].numel() == 2 * 8 * 6
    assert torch.equal(out[0], gpt_batch(1, size=8)[0])
    assert host.log[:2] == [("wait", 0), ("record", 0)]  # the first call: a wait that returns at once
    assert host.log[2] == ("wait", 0)  # before the small buffer is let go
    assert host.log[3:] == [("wait", 1), ("record", 1)]
    stage.to_device(gpt_batch(2, size=2))  # a smaller batch fits in the grown buffer
    assert len(host.buffers) == 2 and small.numel() == 2 * 2 * 6


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_buffer_is_overwritten_only_after_waiting_for_its_last_copies(slots):
    stage, host = staging(slots)
    batches = [gpt_batch(step) for step in range(3 * slots + 1)]
    for batch in batches:
        stage.to_device(batch)
    for call, _ in enumerate(batches):
        slot = call % slots
        fence = host.fences[slot]
        assert host.log[2 * call : 2 * call + 2] == [("wait", slot), ("record", slot)]
        # At its wait, the slot's buffer still held the batch its last copies read: written after the wait.
        held = fence.held_at_wait[call // slots]
        if call >= slots:
            assert torch.equal(held, torch.cat([tensor.reshape(-1) for tensor in batches[call - slots]]))
        else:
            assert (held == -1).all()  # a new buffer, never written


def test_an_empty_batch_passes():
    stage, _ = staging()
    inputs, targets = stage.to_device((torch.empty(0, 6, dtype=torch.long), torch.empty(0, 6, dtype=torch.long)))
    assert inputs.shape == targets.shape == (0, 6)


def test_on_the_host_the_loop_copies_nothing():
    assert batch_staging(torch.device("cpu")) is None
    inputs, targets = torch.randn(4, 3), torch.randn(4, 1)
    moved = to_device((inputs, targets), None)
    assert moved[0] is inputs and moved[1] is targets


def test_slots_must_be_at_least_one():
    with pytest.raises(ValueError, match="at least 1"):
        PinnedStaging(torch.device("cpu"), slots=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_copies_queued_behind_work_still_deliver_each_steps_batch():
    device = torch.device("cuda", torch.cuda.current_device())
    stage = PinnedStaging(device)
    sources, moved = [], []
    for step in range(6):
        # Keep the stream busy, so each copy is still queued when the next batch is written:
        # without the wait before overwriting, a copy would read a later step's bytes.
        torch.cuda._sleep(20_000_000)
        tokens = torch.randint(1000, (256, 513))
        sources.append((tokens[:, :-1], tokens[:, 1:]))
        moved.append(stage.to_device(sources[-1]))
    torch.cuda.synchronize(device)
    for (inputs, targets), (on_gpu_inputs, on_gpu_targets) in zip(sources, moved):
        assert on_gpu_inputs.device == device and on_gpu_inputs.is_contiguous()
        assert torch.equal(on_gpu_inputs.cpu(), inputs) and torch.equal(on_gpu_targets.cpu(), targets)
    buffers = [stage.buffers(slot)[torch.long] for slot in (0, 1)]
    assert all(buffer.tensor.is_pinned() for buffer in buffers)
    assert buffers[0].tensor.data_ptr() != buffers[1].tensor.data_ptr()
