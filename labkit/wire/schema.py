"""The shapes of what ranks send back to the notebook, in one place.

Everything that crosses from a rank to the notebook is a plain dict (it pickles
cheaply and needs no labkit class on the other side); the ``TypedDict``s here
name its keys and types, so the rank code that writes them and the notebook
code that reads them (reports, metrics, dashboard, timeline) agree. The kinds of
failure a rank can report are spelled here only.
"""

from __future__ import annotations

from typing import NotRequired, Optional, TypedDict


class FailureKind:
    """How a rank's work failed; ``spec.errors.RankFailure`` groups ranks by it."""

    RAISED = "raised"  # the user's code raised
    COLLECTIVE = "collective"  # failed because a peer failed or hung (connection closed, timed out)
    INTERRUPTED = "interrupted"  # KeyboardInterrupt (the lab's escalation or the user), or unresponsive
    DIED = "died"  # the process exited

    ALL = (RAISED, COLLECTIVE, INTERRUPTED, DIED)


class ErrorInfo(TypedDict):
    type: str  # the exception's class name
    message: str
    traceback: str  # from the user's code down
    kind: str  # one of FailureKind.ALL


class RankReport(TypedDict, total=False):
    """What one rank returns for one piece of work (``rank.runtime`` or ``runs.dispatch``)."""

    rank: int
    ok: bool
    value: object  # a function's result
    display: Optional[str]  # a cell's last expression, as repr
    rich: dict  # that expression's richer forms (a MIME bundle without text/plain), when it has any
    seconds: float
    error: ErrorInfo
    groups: dict  # group name -> its state at the end of the work (``LabGroups.state()``: what runs.deadlock reads)


class StepRow(TypedDict):
    """One training step on one rank, as the instruments measured it (``rank.instruments.recorder``)."""

    step: int  # counted from the start of this run
    rank: int
    start: float  # wall clock, seconds
    seconds: float  # the whole step
    compute: float  # the rank was busy (CPU) or the device computed (GPU)
    exposed_comm: float  # seconds - compute: waiting for communication it could not overlap
    comm: dict  # collective kind -> seconds from issue to completion
    bytes: dict  # collective kind -> bytes sent
    # This rank's samples and tokens, counted once per data-parallel replica: where tensor- or pipeline-parallel
    # peers see the same batch, each counts its share of it, so summing over ranks gives the step's batch.
    samples: float
    tokens: Optional[float]
    loss: Optional[float]
    delay: float  # injected slowdown (lab.slow)
    cpu: NotRequired[float]  # CPU ranks: the main thread's CPU time alone (what straggler scores compare)
    scalars: NotRequired[dict]  # name -> number: what a loop the lab did not write logged (``labkit.log``)


class StepWindow(TypedDict):
    """The newest step rows of one rank, as its publisher sends them while a run trains."""

    rank: int
    seq: int  # counts the windows this rank published: an older one arriving late is dropped
    rows: list[StepRow]
    memory: NotRequired["MemoryBytes"]  # what the rank holds now, where its publisher knows (a watched loop)


class TimelineStep(TypedDict):
    """The intervals of one recent step on one rank, for the timeline view."""

    step: int
    rank: int
    start: float
    end: float
    busy: list  # (start, end, busy fraction) spans
    collectives: list  # (kind, bytes, issued, completed)


class MemoryBytes(TypedDict):
    params: int
    grads: int
    optimizer: int


def total_bytes(memory: MemoryBytes) -> int:
    """What a rank holds for training: parameters, gradients and optimizer state."""
    return memory["params"] + memory["grads"] + memory["optimizer"]


class Verdict(TypedDict):
    """The equivalence proof: distributed against single-process training (``rank.verify``)."""

    max_relative_difference: float
    model_moved: float
    max_elementwise_difference: float
    rounding_noise: float
    bound: float
    worst_parameter_here: str
    parameters_compared_here: int
    # Parameters holding NaN or infinity, the most on any rank: the run's and the single-process reference's
    # (compared numbers would say nothing then), and the first such parameter of this rank, by name.
    nonfinite_run: NotRequired[int]
    nonfinite_reference: NotRequired[int]
    nonfinite_parameter_here: NotRequired[str]


class NonFiniteStep(TypedDict):
    """A step whose loss was NaN or infinite on some rank, as every rank agreed (``rank.nonfinite``)."""

    step: int  # as the progress lines number it: 1 for a run's first step, counting on across continuations
    ranks: list  # the ranks whose loss was not finite
    values: list  # their losses, in the same order: 'nan', 'inf' or '-inf'


class RankResult(TypedDict, total=False):
    """One rank's account of a training run (``rank.loop.train``)."""

    rank: int
    role: str  # 'trainer', or a role a strategy gives (e.g. 'server')
    coordinate: dict  # mesh axis -> index
    owns_loss: bool  # under pipeline parallelism only the last stage computes the loss
    first_step: int  # steps the state had taken before this run (a continuation)
    losses: Optional[list]
    step_seconds: list
    steps_done: int
    memory: MemoryBytes
    rows: list  # StepRow
    timeline: list  # TimelineStep
    device_name: str
    checkpoints: list  # the checkpoint directories this run saved (checkpoint_every)
    verify: Verdict
    nonfinite: list  # NonFiniteStep: steps stopped at or skipped (on_nonfinite), in order
    strategy_results: dict  # what the strategy measured ("staleness": per applied update; "summary": a line)


class LoopResult(TypedDict):
    """One rank's account of a loop the lab did not write, watched (``rank.instruments.loop_watch``)."""

    rank: int
    rows: list  # StepRow, one per step the watch found
    timeline: list  # TimelineStep
    memory: MemoryBytes  # of the data-parallel module and the optimizers that stepped
    steps_done: int
    notes: list  # what the watch could not see, in words
    found: Optional[str]  # the class of the data-parallel module whose batches were counted
    stopped: bool  # a stop the notebook asked for was raised in the loop
    value: object  # what the work returned (a script: None; a cell: its last expression's repr)


EQUIVALENCE_TOLERANCE = 1e-5  # equal: within the larger of this and NOISE_FACTOR x the run's rounding noise
NOISE_FACTOR = 10.0  # (see rank/verify.py: one process summing in another order measures the noise)
LARGEST_BOUND = 1e-3  # past this, rounding noise would hide real errors: never equal


def equivalence_bound(rounding_noise: float) -> float:
    """max(1e-5, 10 x rounding noise), never above 1e-3 (where noise would hide real errors)."""
    return min(max(EQUIVALENCE_TOLERANCE, NOISE_FACTOR * rounding_noise), LARGEST_BOUND)




class VariableInfo(TypedDict, total=False):
    """What a rank says of one of its variables (``lab.who``, ``rank.names``); a key is there when it applies."""

    type: str  # the class name ("Tensor", "Linear"), or "function", "class"
    shape: list  # a tensor's or array's shape (a DTensor's global shape)
    dtype: str  # "float32", without "torch."
    device: str  # "cpu", "cuda:0"
    placement: str  # a DTensor's placements and mesh, in words
    parameters: int  # an nn.Module's parameter count
    length: int  # a list's, tuple's, dict's or set's
    value: str  # a number's, string's, bool's or None's repr, cut short
