"""The proof against one big machine: retrain in one process, compare every parameter.

Runs on every rank after a run with ``verify=True``. The rank trains the same
model on the same global batches in plain single-process PyTorch, then compares
each parameter it holds, gathered whole (``full_tensor`` for sharded ones), with
the reference: the relative difference ``||a - b|| / ||b||`` of the whole
tensor, the worst over parameters and ranks. A strategy that is not
one-process training by design (DiLoCo) supplies its own single-process
reference (``reference_for``), and the same comparison follows.

What counts as equal. Float32 sums in another order round differently, and a
distributed run sums gradients in another order by construction. Usually that
stays far below 1e-5, but AdamW can amplify it: it divides each element's step
by that element's own gradient size, so an element whose gradient nearly
cancels (often in a bias that starts at zero and has moved little) carries its
rounding straight into its update, and its tensor's relative difference can
reach 1e-5 after ten steps with nothing wrong (seed 0 of the zoo's GPT does).
So the reference is also trained a second time in one process, the same
batches summed in chunks (the way data-parallel ranks split them): how far that
lands from the first reference is this run's rounding noise. The run is equal
when its difference stays within ``max(1e-5, 10 x noise)`` (never above 1e-3,
where noise would hide errors); a real error (a gradient not averaged, a shard
applied twice) lands orders of magnitude above.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.rank.lab_traffic import control_tensor
from labkit.spec.train_config import TrainConfig
from labkit.strategies.catalog import strategy
from labkit.strategies.rank_side import OwnReference, Parameters, rank_module
from labkit.torch_support.optimizers import make_optimizer
from labkit.torch_support.torch_internals import DTENSOR_REDISTRIBUTE_LOGGER
from labkit.wire.schema import Verdict, equivalence_bound
from labkit.torch_support.batches import chunk_rows, to_device
from labkit.torch_support.trainable import Trainable, declared_trainable, initial_network

# (config, device, steps, chunks) -> (initial, final) parameters of a single-process reference.
Reference = Callable[..., tuple[Parameters, Parameters]]


@torch.enable_grad()
def reference_parameters(config: TrainConfig, device: str | torch.device, steps: int, chunks: int = 1,
                         trainable: Trainable | None = None) -> tuple[Parameters, Parameters]:
    """(initial, final) parameters of ``steps`` single-process steps on the same global batches.

    ``chunks`` > 1 sums each step's gradient over that many equal parts of the
    batch: the same mathematics, another rounding. ``trainable``: what the run
    trains (default: the catalog model ``config`` names).
    """
    device = torch.device(device)
    trainable = trainable or declared_trainable(config)
    network = initial_network(trainable, config.seed, device)
    initial = {name: p.detach().clone() for name, p in network.named_parameters()}
    optimizer = make_optimizer(network.parameters(), config, device)
    for step in range(steps):
        batch = to_device(trainable.batch(step, config.global_batch), lambda tensors: tuple(t.to(device) for t in
                                                                                             tensors))
        optimizer.zero_grad(set_to_none=True)
        for piece in chunk_rows(batch, chunks):
            (trainable.loss(trainable.call(network, piece), piece) / chunks).backward()
        optimizer.step()
    return initial, {name: p.detach() for name, p in network.named_parameters()}


def reference_for(config: TrainConfig, parallel, trainable: Trainable) -> Reference:
    """``(config, device, steps, chunks) -> (initial, final)``: the run's single-process reference.

    A strategy that is not one-process training (DiLoCo's replicas drift apart
    between outer steps) offers its own (``rank_side.OwnReference``), given
    this rank's share of the data (which replica it is); else plain training on
    the whole batch.
    """
    for part in config.parts:
        module = rank_module(strategy(part))
        if isinstance(module, OwnReference):
            return functools.partial(module.reference_parameters, data_share=parallel.data_share,
                                     trainable=trainable)
    return functools.partial(reference_parameters, trainable=trainable)


def relative_difference(value: torch.Tensor, expected: torch.Tensor) -> float:
    return float((value - expected).norm() / expected.norm().clamp_min(1e-30))


def resummed_chunks(config: TrainConfig) -> int:
    """How the rounding-noise reference splits each batch: as the dp ranks and microbatches do, at least in two."""
    chunks = max(2, config.data_parts * (config.micro_batches or 1))
    return chunks if config.global_batch % chunks == 0 else 1


@torch.no_grad()
def compare_with_reference(config: TrainConfig, parallel, device, steps: int, trainable: Trainable) -> Verdict:
    """Largest relative difference to single-process training, over all parameters and ranks."""
    reference_of = reference_for(config, parallel, trainable)
    initial, reference = reference_of(config, device, steps)
    _, resummed = reference_of(config, device, steps, chunks=resummed_chunks(config))
    noise = max(relative_difference(resummed[name], reference[name]) for name in reference)
    # Gathering a 2-D sharded parameter whole takes two all-gathers; torch warns
    # about that on every parameter, which is noise for a one-off comparison.
    logging.getLogger(DTENSOR_REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    worst_difference, worst_name, worst_elementwise, compared = 0.0, "", 0.0, 0
    # NaN or infinity on either side makes every difference NaN, and NaN compares as nothing: counted and
    # said instead, so a run whose parameters are NaN is never called equal.
    nonfinite_run, nonfinite_reference, nonfinite_name = 0, 0, ""
    # What this rank holds of the reference, by its own parameters' names (a parameter server's shard).
    held = reference if parallel.reference_view is None else parallel.reference_view(reference)
    for name, parameter in parallel.named_parameters():
        whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()
        expected = held[name]
        run_finite, reference_finite = bool(whole.isfinite().all()), bool(expected.isfinite().all())
        nonfinite_run += not run_finite
        nonfinite_reference += not reference_finite
        if not (run_finite and reference_finite):
            nonfinite_name = nonfinite_name or name
            continue
        difference = relative_difference(whole, expected)
        # The largest single element's error, relative to the tensor's largest
        # element, is reported too (larger under AdamW, see above).
        elementwise = float((whole - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
        compared += 1
        worst_elementwise = max(worst_elementwise, elementwise)
        if difference > worst_difference:
            worst_difference, worst_name = difference, name
    # How far training moved the whole model: equality after no movement would prove nothing.
    moved = sum(float((reference[n] - initial[n]).norm() ** 2) for n in reference) ** 0.5
    size = sum(float(initial[n].norm() ** 2) for n in reference) ** 0.5
    largest_update = moved / max(size, 1e-30)
    # Every rank compared its own share; the verdict is the worst over all ranks.
    worst = control_tensor([worst_difference, largest_update, worst_elementwise, noise, nonfinite_run,
                            nonfinite_reference], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    noise = float(worst[3])
    return {
        "nonfinite_run": int(worst[4]),
        "nonfinite_reference": int(worst[5]),
        "nonfinite_parameter_here": nonfinite_name,
        "max_relative_difference": float(worst[0]),
        "model_moved": float(worst[1]),
        "max_elementwise_difference": float(worst[2]),
        "rounding_noise": noise,
        "bound": equivalence_bound(noise),
        "worst_parameter_here": worst_name,
        "parameters_compared_here": compared,
    }
