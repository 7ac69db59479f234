"""A network split while it was on the meta device, given its starting values afterwards from one whole copy.

Where a strategy shards the network (FSDP, tensor or pipeline parallelism),
no rank needs the whole of it, so the ranks build it on the meta device (no
memory), let the strategy split it there, and only then give their pieces
memory (``to_empty``) and values. The values are those of one ordinary build
of the network on the CPU of rank 0 with the run's seed: the same weights as a
model built whole, wherever it is split, so the proof of equivalence, a
checkpoint and a continuation do not depend on how the network started.

Rank 0 sends the tensors in packets of at most ``PACKET_BYTES`` (a tensor
larger than that alone), and each rank copies out its own shard of each
(a DTensor's local slice, a whole plain tensor; nothing of a tensor it does not
hold, such as another pipeline stage's). So a rank holds its pieces and one
packet in flight, the whole network exists once, in rank 0's host memory, never
on a GPU, and a small network crosses in one message rather than one per
tensor. Buffers kept out of the state dict (``persistent=False``: masks,
rotary tables) travel too, since they are not in the state dict.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from labkit.torch_support.torch_internals import local_slices

PACKET_BYTES = 64 * 2**20
_ALIGN = 16  # every tensor starts at a multiple of this in a packet, so its bytes view as any dtype

Listing = list[tuple[str, tuple[int, ...], torch.dtype]]  # (name, shape, dtype) in the order sent


def fill_from_rank0(network: nn.Module, whole: nn.Module | None, device: torch.device, transfer: torch.device,
                    group: dist.ProcessGroup | None = None) -> None:
    """Give ``network`` (split on the meta device) memory on ``device`` and the values of ``whole``, which
    rank 0 of ``group`` passes (the network built whole on its CPU; None on the other ranks).

    ``transfer``: where the group carries tensors (the CPU for gloo, this rank's GPU for nccl). Every rank
    of the group takes part, whatever it holds."""
    ties = _tied(network)
    network.to_empty(device=device)
    _tie_again(network, ties)
    source = _every_tensor(whole) if whole is not None else {}
    listed: list[object] = [[(name, tuple(value.shape), value.dtype) for name, value in source.items()]]
    dist.broadcast_object_list(listed, src=0, group=group)  # rank 0's list replaces the others'
    listing: Listing = listed[0]  # type: ignore[assignment]
    mine = _every_tensor(network)
    _agree_nothing_missing(sorted(set(mine) - {name for name, _, _ in listing}), transfer, group)
    for packet in _packets(listing):
        flat = torch.empty(_packet_bytes(packet), dtype=torch.uint8, device=transfer)  # padding is never read
        if whole is not None:
            _pack([source[name] for name, _, _ in packet], flat)
        dist.broadcast(flat, src=0, group=group)
        with torch.no_grad():
            for (name, shape, dtype), value in zip(packet, _unpack(flat, packet)):
                if name in mine:
                    _keep_mine(mine[name], value)


def _tied(network: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (an embedding tied to the output layer)."""
    names: dict[int, list[str]] = {}
    for name, parameter in network.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(network: nn.Module, ties: list[list[str]]) -> None:
    """Share each tied parameter again: ``to_empty`` gives every module holding a meta parameter a new one of
    its own, which would train the tied copies apart."""
    for first, *others in ties:
        kept = network.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            module = network.get_submodule(owner)
            if getattr(module, attribute) is not kept:
                setattr(module, attribute, kept)


def _every_tensor(network: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict's tensors, then the buffers it leaves out, by name (a tied tensor under each name)."""
    tensors = {name: value for name, value in network.state_dict(keep_vars=True).items()
               if isinstance(value, torch.Tensor)}
    tensors.update({name: buffer for name, buffer in network.named_buffers() if name not in tensors})
    return tensors


def _keep_mine(held: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into ``held`` what this rank holds of ``whole``: its shard of a DTensor, else all of it."""
    if isinstance(held, DTensor):
        held.to_local().copy_(whole[local_slices(whole.shape, held)])
    else:
        held.copy_(whole)


def _size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count * dtype.itemsize


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _packets(listing: Listing) -> Iterator[Listing]:
    """The listing cut into packets of at most ``PACKET_BYTES`` (a larger tensor alone), in order."""
    packet: Listing = []
    used = 0
    for entry in listing:
        size = _aligned(_size(entry[1], entry[2]))
        if packet and used + size > PACKET_BYTES:
            yield packet
            packet, used = [], 0
        packet.append(entry)
        used += size
    if packet:
        yield packet


def _packet_bytes(packet: Listing) -> int:
    return sum(_aligned(_size(shape, dtype)) for _, shape, dtype in packet)


def _pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        flat[offset:offset + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _aligned(size)


def _unpack(flat: torch.Tensor, packet: Listing) -> Iterator[torch.Tensor]:
    offset = 0
    for _, shape, dtype in packet:
        size = _size(shape, dtype)
        yield flat[offset:offset + size].view(dtype).view(shape)
        offset += _aligned(size)


def _agree_nothing_missing(missing: list[str], transfer: torch.device, group) -> None:
    """Raise on every rank, or on none, when a rank holds a tensor rank 0's whole network lacks (it would
    keep the garbage ``to_empty`` left); one rank raising alone would leave the others waiting in a send."""
    flag = torch.tensor([1.0 if missing else 0.0], device=transfer)
    dist.all_reduce(flag, group=group)
    if flag.item():
        named = ", ".join(missing[:5]) or "(on another rank)"
        raise RuntimeError(f"the network split on the meta device holds tensors that the whole network built on "
                           f"rank 0 lacks: {named}. The model must build the same tensors on every device: "
                           "make its constructor depend on nothing but its arguments")
