"""``labkit.log`` and ``labkit.step``: what a loop the lab did not write may tell its instruments.

Both do nothing outside a lab rank whose work is watched (a script under plain
torchrun, a cell run without instruments), so a script that uses them still
runs anywhere. Inside one they reach the rank's ``LoopWatch``
(``labkit.rank.instruments.loop_watch``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def _watch():
    if "IPython" not in sys.modules:  # a plain process (torchrun): no lab here, and nothing more to import
        return None
    from labkit.rank.instruments.loop_watch import current_watch

    return current_watch()


def log(**scalars) -> None:
    """Add ``loss`` and any other scalars (numbers or 0-d tensors) to the row of the step under way.

    ``labkit.log(loss=loss)``: the loss the loop computed, as the dashboard plots it; a GPU tensor is
    read once its step has passed, never by waiting inside the step."""
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
    watch = _watch()
    if watch is None:
        yield
        return
    with watch.marked_step(samples, tokens):
        yield
