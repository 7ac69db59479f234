"""What a run says of losses that were NaN or infinite (``on_nonfinite``), in one line each; pure, no torch.

The ranks agree on each step whose loss was not finite (``rank.nonfinite``) and
return those steps with their results. Where nothing was agreed (``continue``, or
a strategy whose ranks never stand at one step together), the steps are read
from the losses the ranks kept. Three outcomes:

- a stopped run raises ``NonFiniteLoss`` with ``stop_line``: the step, the ranks,
  the last finite loss, what state the model is in and what to do;
- a run that skipped steps, or trained on, carries ``summary_line`` in its
  report and prints it once when it ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit.spec.errors import LabError, format_ranks
from labkit.wire.schema import NonFiniteStep, RankResult


class NonFiniteLoss(LabError):
    """A run stopped at a step whose loss was NaN or infinite (``on_nonfinite='stop'``).

    ``report``: the run up to the last finite step (None when the first step was not finite)."""

    def __init__(self, line: str, report=None) -> None:
        super().__init__(line)
        self.report = report


def agreed_steps(results: Sequence[RankResult]) -> list[NonFiniteStep]:
    """The steps the ranks agreed were not finite (every rank returns the same list)."""
    for result in results:
        if result.get("nonfinite"):
            return list(result["nonfinite"])
    return []


def seen_steps(results: Sequence[RankResult], first_step: int) -> list[NonFiniteStep]:
    """The steps whose loss was not finite on some rank, read from each rank's losses (nothing was agreed)."""
    found: dict[int, NonFiniteStep] = {}
    for result in results:
        for index, loss in enumerate(result.get("losses") or ()):
            if loss is None or math.isfinite(loss):
                continue
            step = found.setdefault(index, {"step": first_step + index + 1, "ranks": [], "values": []})
            step["ranks"].append(result["rank"])
            step["values"].append(_value_name(loss))
    return [found[index] for index in sorted(found)]


def _value_name(loss: float) -> str:
    return "nan" if math.isnan(loss) else "inf" if loss > 0 else "-inf"


def where(step: NonFiniteStep) -> str:
    """'nan on rank 1', 'nan on ranks 0, 1', 'nan on rank 0, inf on rank 2'."""
    by_value: dict[str, list[int]] = {}
    for rank, value in zip(step["ranks"], step["values"]):
        by_value.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on {format_ranks(ranks)}" for value, ranks in by_value.items())


def stop_line(step: NonFiniteStep, last_loss: float | None, last_step: int) -> str:
    """One line for a run stopped at ``step``; ``last_loss``: the loss of step ``last_step`` (None: no step
    of this run was finite)."""
    if last_loss is None:
        before = (f"no step of this run had a finite loss; the model is as it was before the run" if last_step == 0
                  else f"no step of this run had a finite loss; the model is as step {last_step} left it")
    else:
        before = f"last finite loss {last_loss:.4f} at step {last_step}; the model is as that step left it"
    return (f"the loss was {where(step)} at step {step['step']}: training stopped there on every rank, "
            f"before that step's update ({before}, resume=True would meet the same batch again). "
            f"Look at that batch, the learning rate or the loss; on_nonfinite='skip' skips such steps")


def summary_line(steps: Sequence[NonFiniteStep], action: str, agreed: bool) -> str | None:
    """The report's line on steps that were not finite and did not stop the run; None when there were none."""
    if not steps:
        return None
    first = steps[0]
    numbers = ", ".join(str(step["step"]) for step in steps[:8]) + (", ..." if len(steps) > 8 else "")
    count = f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    if action == "skip" and agreed:
        return (f"skipped the update of {count} whose loss was not finite: step {numbers} "
                f"(first: {where(first)})")
    why = ("on_nonfinite='continue'" if action == "continue"
           else "this strategy's ranks never stand at one step together, so none was stopped or skipped")
    return (f"warning: the loss was not finite in {count} ({numbers}; first: {where(first)} at step "
            f"{first['step']}), and training went on ({why}): the model may hold NaN")
