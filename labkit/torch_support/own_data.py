"""Users' own data as ``Batches``: any step's global batch, or one rank's share of it, from (seed, step) alone.

``lab.train(..., data=...)`` takes a map-style ``torch.utils.data.Dataset``, a
function ``(step, generator) -> batch``, or a factory of no arguments that
returns either (so a large dataset is loaded where it is used, on the ranks).
``batches_for`` turns it into one of:

- ``DatasetBatches``: the dataset read as an endless stream of epochs, each a
  permutation drawn from the seed and the epoch number. Global batch ``step``
  is stream positions [step*size, (step+1)*size); a rank fetches only the
  samples of its own share of them.
- ``GeneratedBatches``: the function called with the step and a generator
  seeded from the seed and the step, the same on every rank.

Either way a batch depends on nothing but (seed, step, size), so every rank
makes its share by itself, and the single-process reference the whole batch:
distributed training sees exactly the samples one process would.

A batch is a tensor, or tuples, lists or dicts of tensors (any nesting), each
with one row per sample (``labkit.torch_support.batches`` works on them).
Torch is imported inside the functions: the notebook side imports this
module without loading it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

from labkit.torch_support.batches import check_batch, take_rows

if TYPE_CHECKING:
    import torch

Batch = Any  # a tensor, or a tuple, list or dict (any nesting) of them, each with one row per sample

_READABLE = ("a map-style torch.utils.data.Dataset (with __getitem__ and __len__) or a function "
             "(step, generator) -> batch")
_ACCEPTED = f"{_READABLE}, or a function of no arguments returning either"
_EXAMPLE = "e.g. data=TensorDataset(inputs, labels) or data=lambda step, generator: (torch.randn(32, 8, " \
           "generator=generator), torch.randint(10, (32,), generator=generator))"

_MASK = (1 << 64) - 1
_EPOCH_STREAM, _STEP_STREAM = 1, 2


def _splitmix(value: int) -> int:
    """SplitMix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def mixed_seed(seed: int, stream: int, number: int) -> int:
    """A generator seed for ``number`` (an epoch, a step) of one ``stream`` of the run seeded ``seed``; seeds that
    differ in any of the three give unrelated draws."""
    return _splitmix(_splitmix(_splitmix(seed & _MASK) ^ stream) ^ (number & _MASK))


def _generator(seed: int) -> torch.Generator:
    import torch

    return torch.Generator().manual_seed(seed)


def _positions(step: int, size: int, index: int, parts: int) -> tuple[int, int]:
    """The stream positions [start, stop) of share ``index`` of ``parts`` of global batch ``step``."""
    if size < 1 or step < 0 or not 0 <= index < parts:
        raise ValueError(f"no share {index} of {parts} of step {step}'s batch of {size}: the step must be at least 0, "
                         f"the size at least 1, and the share one of 0..{parts - 1}")
    return step * size + index * size // parts, step * size + (index + 1) * size // parts


class DatasetBatches:
    """A map-style dataset as an endless stream of epochs, each a fresh permutation drawn from (seed, epoch).

    Global batch ``step`` of ``size`` holds stream positions [step*size,
    (step+1)*size), so a batch may end one epoch and begin the next, and a
    dataset smaller than the batch is simply read more than once. Samples are
    collated with ``torch.utils.data.default_collate`` (tuples, dicts, numbers
    and numpy arrays become tensors of one row per sample). With
    ``shuffle=False`` every epoch is the dataset in its own order.
    """

    def __init__(self, dataset: Any, seed: int, shuffle: bool = True) -> None:
        length = len(dataset)
        if length == 0:
            raise ValueError(f"your data, {describe_data(dataset)}, is empty: give a dataset with at least one sample")
        self.dataset, self.seed, self.shuffle, self.length = dataset, seed, shuffle, length
        self._orders: dict[int, Sequence[int]] = {}

    def order(self, epoch: int) -> Sequence[int]:
        """The dataset's indices in the order epoch ``epoch`` reads them (kept while the stream is in that epoch)."""
        if not self.shuffle:
            return range(self.length)
        if epoch not in self._orders:
            import torch

            generator = _generator(mixed_seed(self.seed, _EPOCH_STREAM, epoch))
            order = torch.randperm(self.length, generator=generator).tolist()
            # The stream moves forward: the epoch before this one may still be read (a batch across the boundary).
            self._orders = {kept: value for kept, value in self._orders.items() if kept >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def indices(self, start: int, stop: int) -> list[int]:
        """The dataset's indices at stream positions [start, stop)."""
        found: list[int] = []
        while start < stop:
            epoch, offset = divmod(start, self.length)
            end = min(stop, (epoch + 1) * self.length)
            found.extend(self.order(epoch)[offset : offset + end - start])
            start = end
        return found

    def _collated(self, start: int, stop: int) -> Batch:
        from torch.utils.data import default_collate

        return default_collate([self.dataset[index] for index in self.indices(start, stop)])

    def batch(self, step: int, size: int) -> Batch:
        """Global batch ``step``: ``size`` samples, collated."""
        return self._collated(*_positions(step, size, 0, 1))

    def share(self, step: int, size: int, index: int, parts: int) -> Batch:
        """Rows [index*size//parts, (index+1)*size//parts) of global batch ``step``, fetching only those samples."""
        return self._collated(*_positions(step, size, index, parts))

    def epoch_of(self, step: int, size: int) -> float:
        """Epochs read before global batch ``step`` (so ``epoch_of(steps, size)`` after ``steps`` steps)."""
        return step * size / self.length


class GeneratedBatches:
    """A function ``(step, generator) -> batch`` as ``Batches``: the generator is seeded from (seed, step).

    The function makes the whole global batch, on every rank: a rank's share is
    cut from it, so each rank pays for the whole batch's making. Give a dataset
    instead where making a batch costs more than the step.
    """

    def __init__(self, function: Callable[[int, torch.Generator], Batch], seed: int) -> None:
        self.function, self.seed = function, seed

    def batch(self, step: int, size: int) -> Batch:
        """Global batch ``step``, checked to have ``size`` rows."""
        made = self.function(step, _generator(mixed_seed(self.seed, _STEP_STREAM, step)))
        try:
            rows = check_batch(made, f"your data function's batch of step {step}")
        except TypeError as error:
            raise ValueError(str(error)) from None
        if rows != size:
            raise ValueError(f"your data function returned {rows} rows for step {step}; the run's global_batch is "
                             f"{size}: pass global_batch={rows} (or make the function return {size})")
        return made

    def share(self, step: int, size: int, index: int, parts: int) -> Batch:
        """Rows [index*size//parts, (index+1)*size//parts) of global batch ``step`` (made whole, then cut)."""
        start, stop = _positions(step, size, index, parts)
        return take_rows(self.batch(step, size), start - step * size, stop - step * size)


def _positional_counts(function: Callable) -> tuple[int, float] | None:
    """(required, most) positional arguments ``function`` takes (most is infinite with ``*args``), or None
    when Python cannot tell."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    most = float("inf") if any(p.kind == p.VAR_POSITIONAL for p in parameters) else len(positional)
    return required, most


def _is_dataset(data: object) -> bool:
    indexed = hasattr(data, "__getitem__") and hasattr(data, "__len__")
    return indexed and not inspect.isclass(data) and not isinstance(data, (str, bytes, Mapping))


def _is_stream(data: object) -> bool:
    """An iterable dataset or a loader: samples one after another, none by index."""
    from torch.utils.data import DataLoader, IterableDataset

    if inspect.isclass(data):
        return False  # a class is called, as a factory
    return isinstance(data, (IterableDataset, DataLoader)) or (hasattr(data, "__iter__") and not _is_dataset(data))


def batches_for(data: Any, seed: int, shuffle: bool = True) -> DatasetBatches | GeneratedBatches:
    """The ``Batches`` for ``data``: a map-style dataset, a function (step, generator) -> batch, or a function of
    no arguments returning one of those (called here, once). TypeError, saying what to give, for anything else."""
    return _batches_for(data, seed, shuffle, factory_allowed=True)


def _batches_for(data: Any, seed: int, shuffle: bool, factory_allowed: bool) -> DatasetBatches | GeneratedBatches:
    if _is_stream(data):
        raise TypeError(f"your data, {describe_data(data)}, gives samples one after another, but every rank must make "
                        f"any step's batch by itself: give a map-style Dataset (with __getitem__ and __len__) or a "
                        f"function (step, generator) -> batch, {_EXAMPLE}")
    if _is_dataset(data):
        return DatasetBatches(data, seed, shuffle)
    if callable(data):
        counts = _positional_counts(data)
        if counts is not None and 1 <= counts[0] <= 2 <= counts[1]:
            return GeneratedBatches(data, seed)
        if counts is not None and counts[0] == 0:
            if factory_allowed:
                return _batches_for(data(), seed, shuffle, factory_allowed=False)
            raise TypeError(f"your data function returned another function of no arguments, "
                            f"{describe_data(data)}: return {_READABLE}, {_EXAMPLE}")
        taken = "its parameters could not be read" if counts is None else (
            f"it takes {counts[0]} argument{'s' if counts[0] != 1 else ''}")
        raise TypeError(f"your data, {describe_data(data)}, is a function, but {taken}: give {_ACCEPTED}, {_EXAMPLE}")
    raise TypeError(f"your data is {_a(type(data).__name__)}: give {_ACCEPTED}, {_EXAMPLE}")


def is_factory(data: Any) -> bool:
    """Whether ``data`` is a function of no arguments that makes the data (called on the ranks, not here)."""
    if _is_dataset(data) or _is_stream(data) or not callable(data):
        return False
    counts = _positional_counts(data)
    return counts is not None and counts[0] == 0


def describe_data(data: Any) -> str:
    """One short phrase for messages: "TensorDataset of 1,797 samples", "function make_batch(step, generator)"."""
    if inspect.isclass(data):
        return f"class {data.__name__}"
    if _is_dataset(data):
        try:
            return f"{type(data).__name__} of {len(data):,} samples"
        except TypeError:
            return type(data).__name__
    if callable(data) and not hasattr(data, "__iter__"):
        name = getattr(data, "__name__", type(data).__name__)
        try:
            parameters = ", ".join(inspect.signature(data).parameters)
        except (TypeError, ValueError):
            parameters = "..."
        return f"function {name}({parameters})"
    return _a(type(data).__name__)


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def batch_share(batches: Any, step: int, size: int, index: int, parts: int) -> Batch:
    """Share ``index`` of ``parts`` of global batch ``step``: by the object's own ``share`` where it has one, else
    cut from its whole ``batch`` (the zoo's own data has only that)."""
    if hasattr(batches, "share"):
        return batches.share(step, size, index, parts)
    start, stop = _positions(step, size, index, parts)
    return take_rows(batches.batch(step, size), start - step * size, stop - step * size)
