"""A tensor-parallel plan tried on the meta device, in the notebook: whether its shapes fit, and one to suggest.

Tensor parallelism leaves each rank a slice of every split layer: a colwise
``nn.Linear`` keeps ``out_features / tp`` of its outputs, a rowwise one reads
``in_features / tp`` of its inputs, and everything between them computes on
those slices (torch's styles hand on local tensors). ``plan_failure`` builds that
rank's copy of the network on the meta device (no memory, no ranks: only
shapes are computed) and runs the forward on one sample; a plan whose layers
do not fit together (a gate split rowwise beside an ``up`` split colwise, where
both read the block's input) fails there as it would on every rank.

``suggested_plan`` is what a refusal offers: in the order the first block's
forward calls its Linear layers, each run of layers split colwise followed by
one split rowwise that the meta forward accepts (``q, k, v`` then ``out``;
``gate, up`` then ``down``; ``up`` then ``down``). A plan is suggested only once
it has run this way; where nothing can be tried (data made on the ranks, a
forward the meta device cannot run) the suggestion says the rule in words.

Limits: the trial sees shapes only. A reduction over a split width that keeps
its shape (a softmax over features) passes here and computes something else
on the ranks; styles that move the sequence dimension ("sequence") or torch
``ParallelStyle`` objects are not tried.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from labkit.zoo.own_checks import PLAN_IN_WORDS, STYLE_KINDS, matches

if TYPE_CHECKING:
    from torch import nn

# How each style changes the rank's layer: "colwise" keeps a slice of the outputs, "rowwise" of the inputs; the
# styles that gather what they split (Hugging Face's *_rep) keep the layer's shapes, as the replicated ones do.
_SLICES = {"colwise": "colwise", "rowwise": "rowwise", "embedding_colwise": "colwise",
           "embedding_rowwise": "rowwise", "colwise_rep": None, "colwise_gather_output": None,
           "rowwise_rep": None, "rowwise_split_input": None, "replicate": None, "local": None, "gather": None}


class Untried(Exception):
    """The forward cannot run on the meta device at all (or a style cannot be tried): nothing is learned."""


def plan_failure(network: nn.Module, sample: Any, plan: Mapping[str, object], tp: int) -> str | None:
    """Why one rank's copy of ``network`` under ``plan`` (split ``tp`` ways) fails on ``sample``; None when it runs.

    Raises ``Untried`` when the forward fails without any split too, or the plan holds a style not tried here."""
    for pattern, style in plan.items():
        if not (isinstance(style, str) and style in _SLICES):
            raise Untried(f'"{pattern}": {style!r} is not tried on the meta device')
    failure = _run(network, sample, {}, tp)
    if failure is not None:
        raise Untried(failure)
    return _run(network, sample, plan, _ways(tp))


def suggested_plan(network: nn.Module, sample: Any, tp: int) -> dict[str, str] | None:
    """A plan for the network's blocks that runs on the meta device split ``tp`` ways; None when none was found
    (or none could be tried)."""
    from torch import nn

    from labkit.zoo.own_checks import outline

    shape = outline(network)
    blocks = shape.largest_list()
    first = shape.children_of(blocks)[0] if blocks is not None else ""
    prefix = f"{first}." if first else ""
    try:
        called = _linear_call_order(network, sample)
    except Untried:
        return None
    layers = [name for name in called if name.startswith(prefix) and shape.is_a(name, nn.Linear)]
    pattern = {name: f"{blocks}.*.{name[len(prefix):]}" if blocks is not None else name for name in layers}
    plan: dict[str, str] = {}
    tp, start = _ways(tp), 0
    while start < len(layers):
        for end in range(start + 1, len(layers)):
            trial = {**plan, **{pattern[name]: "colwise" for name in layers[start:end]},
                     pattern[layers[end]]: "rowwise"}
            if _fits(network, trial, tp) and _run(network, sample, trial, tp) is None:
                plan, start = trial, end + 1
                break
        else:
            start += 1
    return plan or None


def example_text(network: nn.Module, sample: Any, tp: int) -> str:
    """The plan to show after ``tp_plan=`` in a message: one that ran on the meta device, or the rule in words."""
    plan = suggested_plan(network, sample, tp) if sample is not None else None
    if not plan:
        return PLAN_IN_WORDS
    return "{" + ", ".join(f'"{name}": "{style}"' for name, style in plan.items()) + "}"


def _ways(tp: int) -> int:
    """How many ways to split in a trial: the run's tp, or 2 where the run does not split (a plan must split)."""
    return tp if tp > 1 else 2


def _fits(network: nn.Module, plan: Mapping[str, str], tp: int) -> bool:
    """Whether ``tp`` divides every width the plan splits (else ``check_tp_plan`` refuses it)."""
    for name, module in network.named_modules():
        for pattern, style in plan.items():
            kind = STYLE_KINDS.get(style)
            if matches(pattern, name) and kind in ("colwise", "rowwise"):
                width = getattr(module, "out_features" if kind == "colwise" else "in_features", 0)
                if width % tp:
                    return False
    return True


def _linear_call_order(network: nn.Module, sample: Any) -> list[str]:
    """The names of the Linear layers in the order the forward first calls them, on the meta device."""
    from torch import nn

    copied = _on_meta(network)
    order: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda module, args, name=name: order.append(name))
             for name, module in copied.named_modules() if isinstance(module, nn.Linear)]
    try:
        failure = _forward(copied, sample)
    finally:
        for hook in hooks:
            hook.remove()
    if failure is not None:
        raise Untried(failure)
    return list(dict.fromkeys(order))


def _run(network: nn.Module, sample: Any, plan: Mapping[str, object], tp: int) -> str | None:
    """Build one rank's slice of ``network`` under ``plan`` on the meta device and run it; the error or None."""
    copied = _on_meta(network)
    for name, module in list(copied.named_modules()):
        for pattern, style in plan.items():
            if matches(pattern, name):
                _slice(module, _SLICES.get(str(style)), tp)
    return _forward(copied, sample)


def _slice(module: nn.Module, kind: str | None, tp: int) -> None:
    """Make ``module`` the slice a rank keeps: its weight (and bias) cut along the split dimension."""
    import torch
    from torch import nn

    if kind is None or not isinstance(module, (nn.Linear, nn.Embedding)):
        return
    weight = module.weight
    # Linear weights are (out, in); Embedding weights (rows, width): a colwise split cuts the outputs.
    if isinstance(module, nn.Linear):
        cut = 0 if kind == "colwise" else 1
    else:
        cut = 1 if kind == "colwise" else 0
    shape = list(weight.shape)
    shape[cut] //= tp
    module.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and kind == "colwise":
        module.bias = nn.Parameter(torch.empty(bias.shape[0] // tp, device="meta"), requires_grad=False)


def _on_meta(network: nn.Module) -> nn.Module:
    copied = copy.deepcopy(network)
    return copied.to("meta")


def _forward(network: nn.Module, sample: Any) -> str | None:
    """Run ``network`` on ``sample`` moved to the meta device; the first line of what it raised, or None."""
    import torch
    import torch.utils._pytree as pytree

    from labkit.torch_support.batches import call_model

    batch = pytree.tree_map(lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value, sample)
    try:
        with torch.no_grad(), torch.device("meta"):
            call_model(network, batch)
    except Exception as error:  # noqa: BLE001 - whatever the forward raises on the meta device is the answer
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
    return None
