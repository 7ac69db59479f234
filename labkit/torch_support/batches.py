"""Batches of any shape: nestings of tuples, lists and dicts whose leaves are tensors of one row per sample.

A user's data may come as ``(inputs, targets)``, as a dict a Hugging Face model
takes (``{"input_ids": ..., "labels": ...}``), or any nesting of those. What
every such batch shares is its rows: each leaf's first dimension is the sample.
These pure functions are all the rest of labkit needs to know about one:

- ``flatten`` and its rebuild: the leaves in a fixed order, and the structure back;
- ``check_batch``: the number of rows, or an error naming the leaf at fault;
- ``take_rows``, ``chunk_rows``, ``to_device``: the same structure, fewer rows or elsewhere;
- ``model_call``, ``call_model``: how a model is called with a batch;
- ``targets_of``, ``default_loss``: what the loss compares with when the user gives no loss;
- ``tokens_per_sample``: a language model's sequence length, for tokens per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

Batch = Any  # a tensor, or a tuple, list or dict (any nesting) of them, each with one row per sample

_EXAMPLE_LOSS = "loss=lambda output, batch: torch.nn.functional.mse_loss(output, batch[1])"


def _is_namedtuple(node: object) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _rebuilt_mapping(original: Mapping, pairs: dict) -> Mapping:
    """A mapping of ``original``'s type holding ``pairs`` where its type can be made from a dict (an
    OrderedDict, Hugging Face's BatchEncoding), else a plain dict."""
    if type(original) is dict:
        return pairs
    try:
        return type(original)(pairs)  # type: ignore[call-arg]
    except TypeError:
        return pairs


def _not_a_tensor(what: str, path: str, leaf: object) -> TypeError:
    name = type(leaf).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return TypeError(f"{what}: {path} is {article} {name}, not a tensor; a batch is a tensor, or tuples, "
                     f"lists or dicts of tensors, each with one row per sample (e.g. (inputs, targets)); "
                     f"make numbers and arrays tensors first, e.g. torch.as_tensor(value)")


def _key_path(path: str, key: object) -> str:
    return f'{path}["{key}"]' if isinstance(key, str) else f"{path}[{key!r}]"


Rebuild = Callable[[Iterator[torch.Tensor]], Batch]


def _rebuilder(node: Batch, path: str, found: list[tuple[str, torch.Tensor]], what: str) -> Rebuild:
    """Appends ``node``'s tensors to ``found``, each with its path (``batch["labels"]``, ``batch[1]``); returns
    what makes ``node``'s structure again from new tensors, taken in the same order from an iterator. A leaf
    that is not a tensor is a TypeError naming ``what`` and its path."""
    if isinstance(node, Mapping):
        keys = list(node.keys())
        parts = [_rebuilder(node[key], _key_path(path, key), found, what) for key in keys]
        return lambda new: _rebuilt_mapping(node, {key: part(new) for key, part in zip(keys, parts)})
    if isinstance(node, (tuple, list)):
        names = [f".{field}" for field in getattr(type(node), "_fields")] if _is_namedtuple(node) else [
            f"[{index}]" for index in range(len(node))]
        parts = [_rebuilder(value, path + name, found, what) for value, name in zip(node, names)]
        if _is_namedtuple(node):
            return lambda new: type(node)(*(part(new) for part in parts))
        if isinstance(node, tuple):
            return lambda new: tuple(part(new) for part in parts)
        return lambda new: [part(new) for part in parts]
    if not isinstance(node, torch.Tensor):
        raise _not_a_tensor(what, path, node)
    found.append((path, node))
    return lambda new: next(new)


def flatten(batch: Batch) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Batch]]:
    """The batch's tensors in a fixed order (dicts in their key order), and what rebuilds the same structure
    (tuples, lists, dicts, namedtuples, each of its own type) from a list of as many tensors in that order."""
    found: list[tuple[str, torch.Tensor]] = []
    build = _rebuilder(batch, "batch", found, "a batch")
    leaves = [tensor for _, tensor in found]
    count = len(leaves)

    def rebuild(tensors: list[torch.Tensor]) -> Batch:
        if len(tensors) != count:
            raise ValueError(f"this batch has {count} tensors; {len(tensors)} were given to rebuild it")
        return build(iter(tensors))

    return leaves, rebuild


def check_batch(batch: Batch, what: str) -> int:
    """The number of rows (samples) in ``batch``; a TypeError or ValueError naming ``what`` (e.g. "your data's
    sample 0") and the leaf at fault when a leaf is not a tensor, is 0-d, or has other rows than the first."""
    found: list[tuple[str, torch.Tensor]] = []
    _rebuilder(batch, "batch", found, what)
    first: tuple[str, int] | None = None
    for path, leaf in found:
        if leaf.dim() == 0:
            raise ValueError(f"{what}: {path} is a 0-d tensor (one number); every tensor of a batch needs a first "
                             f"dimension with one row per sample, e.g. shape (N,) for N labels")
        if first is None:
            first = (path, leaf.shape[0])
        elif leaf.shape[0] != first[1]:
            raise ValueError(f"{what}: {path} has {leaf.shape[0]} rows but {first[0]} has {first[1]}; every tensor "
                             f"of a batch has one row per sample, so their first dimensions must be equal")
    if first is None:
        raise ValueError(f"{what} holds no tensors: a batch is a tensor, or tuples, lists or dicts of tensors, "
                         f"e.g. (inputs, targets)")
    return first[1]


def take_rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of every tensor, in the same structure (views: no copy)."""
    leaves, rebuild = flatten(batch)
    return rebuild([leaf[start:stop] for leaf in leaves])


def chunk_rows(batch: Batch, parts: int) -> list[Batch]:
    """The batch cut into ``parts`` batches of equal rows, in order; ValueError when the rows do not divide."""
    if parts == 1:
        return [batch]  # every step of a run without micro-batches: nothing to cut, nothing to walk
    rows = check_batch(batch, "the batch to split")
    if parts < 1 or rows % parts:
        raise ValueError(f"a batch of {rows} rows does not split into {parts} equal parts: "
                         f"make the rows a multiple of {parts}")
    size = rows // parts
    return [take_rows(batch, index * size, (index + 1) * size) for index in range(parts)]


def to_device(batch: Batch, mover: Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]) -> Batch:
    """The batch with its tensors replaced by ``mover``'s (called once with all of them, as the loop's
    ``PinnedStaging.to_device`` is, so one pinned copy moves the whole batch)."""
    leaves, rebuild = flatten(batch)
    return rebuild(list(mover(tuple(leaves))))


def model_call(batch: Batch) -> tuple[tuple, dict]:
    """The positional and keyword arguments the model is called with: a tensor is the input itself; a dict is
    passed as keywords; a tuple or list gives its first element, the inputs (the rest are targets or extras,
    for the loss), and inputs that are themselves a tuple or a dict are spread: ``((a, b), y)`` calls
    ``model(a, b)``, ``({"ids": i, "mask": m}, y)`` calls ``model(ids=i, mask=m)``."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("an empty tuple is not a batch: give (inputs, targets), e.g. (images, labels)")
        inputs = batch[0]
        if isinstance(inputs, Mapping):
            return (), dict(inputs)
        if isinstance(inputs, (tuple, list)) and not _is_namedtuple(inputs):
            return tuple(inputs), {}
        return (inputs,), {}
    raise TypeError(f"a batch of type {type(batch).__name__} cannot be given to a model: give a tensor, "
                    f"(inputs, targets) or a dict of keyword arguments, e.g. {{'input_ids': ids, 'labels': ids}}")


def call_model(module: Callable[..., Any], batch: Batch) -> Any:
    """``module``'s output for ``batch``, called as ``model_call`` says."""
    args, kwargs = model_call(batch)
    return module(*args, **kwargs)


_TARGET_KEYS = ("labels", "targets", "target")


def targets_of(batch: Batch) -> Any:
    """What the default loss compares the output with: a tuple's or list's second element, or a dict's
    "labels", "targets" or "target"; ValueError for a batch that has none."""
    if isinstance(batch, Mapping):
        for key in _TARGET_KEYS:
            if key in batch:
                return batch[key]
        raise ValueError(f"this batch's dict has no targets (keys {list(batch)}; the default loss looks for "
                         f"'labels', 'targets' or 'target'): add labels to it, or pass loss=, e.g. {_EXAMPLE_LOSS}")
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise ValueError(f"this batch has inputs but no targets (a {type(batch).__name__} of {len(batch)}): "
                             f"give (inputs, targets), or pass loss=, e.g. {_EXAMPLE_LOSS}")
        return batch[1]
    raise ValueError(f"this batch is a single {type(batch).__name__}, with no targets for the default loss: "
                     f"give (inputs, targets), or pass loss=, e.g. {_EXAMPLE_LOSS}")


def _logits_of(output: Any) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model's output is a {type(output).__name__}, with no tensor of logits for the "
                        f"default loss (cross-entropy): pass loss=, e.g. {_EXAMPLE_LOSS}")
    return logits


def _is_class_ids(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of the output's logits against the batch's class ids (labels of -100 are left out);
    the output's own ``loss`` where it has one (a Hugging Face model given ``labels`` in a dict batch).

    The logits are ``output.logits`` (a Hugging Face output), a tuple output's first element, or the output
    itself; the targets are ``targets_of(batch)``: shape (N,) for logits (N, C), or (N, T) for logits (N, T, C).
    """
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.dim() == 0:
        return own  # a Hugging Face model given labels computes its loss itself (causal LMs shift them first)
    logits, targets = _logits_of(output), targets_of(batch)
    fits = (isinstance(targets, torch.Tensor) and _is_class_ids(targets) and targets.dim() >= 1
            and logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape)
    if not fits:
        described = (f"{targets.dtype} targets of shape {tuple(targets.shape)}" if isinstance(targets, torch.Tensor)
                     else f"targets of type {type(targets).__name__}")
        raise ValueError(f"the default loss is cross-entropy on class ids: integer targets of shape (N,) with logits "
                         f"(N, C), or (N, T) with logits (N, T, C); here {described} and logits of shape "
                         f"{tuple(logits.shape)}. For any other loss pass loss=, e.g. {_EXAMPLE_LOSS}")
    targets = targets.reshape(-1)
    if targets.dtype != torch.long:
        targets = targets.long()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


def tokens_per_sample(batch: Batch) -> int | None:
    """The sequence length when the model's input (its first positional argument, or a dict's "input_ids") is a
    2-D tensor of integer token ids; None for any other input."""
    if isinstance(batch, Mapping):
        tokens = batch.get("input_ids")
    else:
        try:
            args, _ = model_call(batch)
        except (TypeError, ValueError):
            return None
        tokens = args[0] if args else None
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and _is_class_ids(tokens):
        return int(tokens.shape[1])
    return None
