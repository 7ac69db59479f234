"""``labkit.log`` and ``labkit.step``: what a loop the lab did not write may tell its instruments.

Both do nothing outside a lab rank whose work is watched (a script under plain
torchrun, a cell run without instruments), so a script that uses them still
runs anywhere. Inside one they reach the rank's ``LoopWatch``
(``labkit.rank.instruments.loop_watch``).
"""

from __future__ import annotations

import contextlib
import numbers
import sys
from collections.abc import Iterator
from typing import Any

# The most one rank may count in one step: far past any real batch (a billion samples, a trillion tokens), and
# short of counts whose rates would be nonsense. A larger one is a mistake (a byte count, a total over the run).
MOST_IN_A_STEP = {"samples": 10**9, "tokens": 10**12}


def _watch():
    if "IPython" not in sys.modules:  # a plain process (torchrun): no lab here, and nothing more to import
        return None
    from labkit.rank.instruments.loop_watch import current_watch

    return current_watch()


def _is_scalar(value: Any) -> bool:
    """A real number (not a bool), or a tensor of one element (numbers only: torch is there if it is one)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1 \
        and not value.is_complex() and value.dtype != torch.bool


def _shown(value: Any) -> str:
    """A wrong value, briefly: a tensor by its shape (its repr may be thousands of numbers), the rest by repr."""
    shape = getattr(value, "shape", None)
    if shape is not None and type(value).__name__ in ("Tensor", "ndarray"):
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def log(**scalars) -> None:
    """Add ``loss`` and any other scalars (numbers or one-element tensors) to the row of the step under way.

    ``labkit.log(loss=loss)``: the loss the loop computed, as the dashboard plots it; a GPU tensor is
    read once its step has passed, never by waiting inside the step. Checked everywhere, under torchrun
    too (where nothing else happens), so a script fails the same way in and out of the lab."""
    for name, value in scalars.items():
        if not _is_scalar(value):
            raise ValueError(f"labkit.log({name}={_shown(value)}): each value is one number, a Python number or a "
                             f"tensor of one element, e.g. labkit.log({name}=loss) with loss = F.mse_loss(...), "
                             f"or labkit.log({name}=values.mean())")
    watch = _watch()
    if watch is not None:
        watch.log(scalars)


@contextlib.contextmanager
def step(samples: int | None = None, tokens: int | None = None) -> Iterator[None]:
    """The block is one training step: for loops with several optimizer steps per step (a GAN), or none.

    ``samples``, ``tokens``: this rank's, when the batch the data-parallel module sees does not say them.
    From the first ``labkit.step`` on, optimizer steps no longer end steps."""
    for name, count in (("samples", samples), ("tokens", tokens)):
        # Checked everywhere, under torchrun too, so a script fails the same way in and out of the lab.
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(f"labkit.step({name}={count!r}): give this rank's {name} in the step as a whole "
                             f"number, 0 or more, e.g. labkit.step({name}=len(batch))")
        if count is not None and count > MOST_IN_A_STEP[name]:
            raise ValueError(f"labkit.step({name}={count:,}): more than {MOST_IN_A_STEP[name]:,} {name} in one step "
                             f"on one rank is not a batch; give this rank's {name} in this step, e.g. "
                             f"labkit.step({name}=len(batch))")
    watch = _watch()
    if watch is None:
        yield
        return
    with watch.marked_step(samples, tokens):
        yield
