"""What a DiLoCo run across sites did: ``SitesReport``, its rounds, each site's part, the bytes through the hub.

``runs.site_diloco`` builds it when the run ends; pure (numpy, no torch). Its losses are per global step,
the mean over the sites that trained that step's slices, as DiLoCo on one machine reports them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy

from labkit.spec.errors import LabError
from labkit.units import format_bytes
from labkit.wire.schema import EQUIVALENCE_TOLERANCE, NOISE_FACTOR, equivalence_bound

if TYPE_CHECKING:
    from labkit.runs.outer_hub import RoundRecord


def parameter_slices(layout: list):
    """(name, shape, slice) of each parameter in a flat vector laid out as ``layout``'s (name, shape)."""
    offset = 0
    for name, shape in layout:
        count = int(numpy.prod(shape)) if shape else 1
        yield name, shape, slice(offset, offset + count)
        offset += count


def largest_relative_difference(got: numpy.ndarray, expected: numpy.ndarray, layout: list) -> float:
    """The largest over parameters of |got - expected| / |expected| (norms), both flat in ``layout``'s order of
    (name, shape): how the lab's verify measures a difference everywhere."""
    worst = 0.0
    for _, _, part in parameter_slices(layout):
        norm = max(float(numpy.linalg.norm(expected[part].astype(numpy.float64))), 1e-30)
        worst = max(worst, float(numpy.linalg.norm((got[part] - expected[part]).astype(numpy.float64))) / norm)
    return worst


@dataclass
class SitesReport:
    """What a DiLoCo run across sites did: its rounds, each site's part, the bytes through the hub, the proof."""

    sites: list[str]
    replicas: int
    inner_steps: int
    wire: str
    rounds: list[RoundRecord]
    losses: list[float]  # per global step: the mean over the sites that trained it (as DiLoCo on one machine)
    model_bytes: int  # the model's float32 bytes
    seconds: float
    events: list[str] = field(default_factory=list)
    weights: dict[int, numpy.ndarray] = field(default_factory=dict)  # the hub's global weights, by holder
    layouts: dict[int, list] = field(default_factory=dict)  # holder -> (parameter name, shape) of its vector
    verify_difference: float | None = None
    # The same reference with its sums in other orders (a replica's gradient in parts, the pseudo-gradients
    # reversed): how far rounding alone moves this run; the bound is the lab's usual one on it.
    verify_noise: float = 0.0

    def model_state(self) -> dict[str, numpy.ndarray]:
        """The trained model (the hub's global weights) by parameter name, as numpy arrays (``torch.from_numpy``
        makes tensors of them). Sites of ddp hold the model whole; under fsdp ask a site: lab.site(name).model_state()."""
        if len(self.weights) != 1:
            raise LabError("the sites sharded the model (inner='fsdp'): lab.site(name).model_state() gathers it")
        flat = self.weights[0]
        return {name: flat[part].reshape(shape).copy() for name, shape, part in parameter_slices(self.layouts[0])}

    @property
    def hub_bytes_per_round(self) -> float:
        """Pseudo-gradients in and updates out, per full round (every site in it), through the hub."""
        full = [r.bytes_in + r.bytes_out for r in self.rounds if len(r.used) == len(self.sites) and r.used]
        return statistics.fmean(full) if full else 0.0

    @property
    def wire_bytes_per_number(self) -> int:
        return 2 if self.wire == "bf16" else 4

    @property
    def verify_bound(self) -> float:
        """The largest difference that is still rounding: max(1e-5, 10 x the rounding noise), at most 1e-3."""
        return equivalence_bound(self.verify_noise)

    @property
    def equivalent(self) -> bool | None:
        """Whether the hub's weights are one-process DiLoCo's (with ``verify``), within ``verify_bound``."""
        return None if self.verify_difference is None else self.verify_difference < self.verify_bound

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def summary_lines(self) -> list[str]:
        full = 2 * len(self.sites) * self.model_bytes * self.wire_bytes_per_number // 4
        lines = [f"DiLoCo across {len(self.sites)} sites ({', '.join(self.sites)}): {len(self.rounds)} rounds of "
                 f"{self.inner_steps} inner steps in {self.seconds:.1f} s, {self.wire} on the wire"]
        if self.losses:
            lines.append(f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}")
        lines.append(f"through the hub per round: {format_bytes(self.hub_bytes_per_round)} (2 x sites x model = "
                     f"{format_bytes(full)} in {self.wire})")
        left = [f"round {r.round}: {', '.join(r.left_out)}" for r in self.rounds if r.left_out]
        if left:
            lines.append("left out (their shares requeued): " + "; ".join(left))
        if self.verify_difference is not None:
            same = "equal" if self.equivalent else "NOT equal"
            lines.append(f"against one-process DiLoCo of {self.replicas} replicas: largest relative difference of a "
                         f"parameter {self.verify_difference:.1e} ({same} within max({EQUIVALENCE_TOLERANCE:g}, "
                         f"{NOISE_FACTOR:g} x the rounding noise {self.verify_noise:.1e}))")
        return lines + self.events

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))
