"""Refusals, in the notebook, of a split a user's own network cannot take: before any rank works.

``lab.train(model=MyNet, fsdp_units=[...], tp_plan={...}, pp_split=[...])``
describes by names how the strategies split a network the zoo does not know.
These checks read those names against a copy of the network (the meta device
will do: only names, classes and shapes are read) and raise ``ValueError``
naming the module or pattern at fault and what to pass instead.
``verify_refusal`` says why the single-process equivalence proof cannot hold.

A ``ModelOutline`` is what the checks and ``own_plan.ModulePlan`` know of a
network: every module's name and class, and how big each ``nn.ModuleList`` is.
A pipeline stage cut from the network keeps its whole network's outline, so a
plan made for the stage still knows the classes and names the cut replaced.

Torch is imported inside the functions: this module loads without it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

# Style names (Hugging Face's, and short ones) -> the kind of split: which width tp must divide.
STYLE_KINDS = {
    "colwise": "colwise", "colwise_rep": "colwise", "colwise_gather_output": "colwise",
    "embedding_colwise": "colwise",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "rowwise_split_input": "rowwise",
    "embedding_rowwise": "rowwise",
    "sequence": "sequence", "sequence_parallel": "sequence",
    "replicate": "replicate", "local": "replicate", "gather": "replicate",
}
# A Hugging Face config's dropout probabilities (its modules may draw dropout without an nn.Dropout).
CONFIG_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                   "hidden_dropout_prob", "attention_probs_dropout_prob")
_SHOWN = 6  # how many names an error lists
# A plan in words: what a message shows where no plan in the model's names was tried (``torch_support.tp_trial``).
PLAN_IN_WORDS = ('{"<the Linear layers that read a block\'s input>": "colwise", '
                 '"<the Linear layer that reads their outputs>": "rowwise"}')


@dataclass(frozen=True)
class ModelOutline:
    """Every module of a network by name (module order, the root as ""), its class, each ModuleList's size, and
    the tensor-parallel plan it publishes (a Hugging Face model's, see ``hf_tp_plan``)."""

    classes: dict[str, type]
    list_sizes: dict[str, int]  # ModuleList name -> its parameter count
    hf_plan: dict[str, str] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.classes)

    def is_a(self, name: str, wanted: type | str) -> bool:
        """Whether module ``name`` is of class ``wanted`` (a class, or a class name compared with the class's own)."""
        cls = self.classes[name]
        return cls.__name__ == wanted if isinstance(wanted, str) else issubclass(cls, wanted)

    def largest_list(self) -> str | None:
        """The ModuleList with the most parameters (the first of equals), None when no list holds any."""
        best = max(self.list_sizes.values(), default=0)
        return next((name for name, size in self.list_sizes.items() if size == best), None) if best else None

    def children_of(self, parent: str) -> list[str]:
        prefix = f"{parent}." if parent else ""
        return [n for n in self.classes if n.startswith(prefix) and n and "." not in n[len(prefix):]]


def outline(model: nn.Module) -> ModelOutline:
    """The outline of ``model``; a pipeline stage cut by ``own_plan`` answers with its whole network's."""
    from torch import nn

    kept = getattr(model, "labkit_outline", None)
    if isinstance(kept, ModelOutline):
        return kept
    modules = dict(model.named_modules())
    sizes = {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()
             if isinstance(module, nn.ModuleList)}
    return ModelOutline({name: type(module) for name, module in modules.items()}, sizes, hf_tp_plan(model))


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a Hugging Face model publishes (full module paths to style names), or None.

    The instance's ``tp_plan`` when it is a non-empty dict, else ``config.base_model_tp_plan`` under the
    ``base_model_prefix`` submodule. Entries for the embeddings and the output head are left out: labkit keeps
    those replicated, so the vocabulary need not divide by tp, tied input and output embeddings stay one
    whole tensor, and the logits come out whole for the loss. Duck-typed: transformers is never imported.
    """
    from torch import nn

    plan = getattr(model, "tp_plan", None)
    if not (isinstance(plan, dict) and plan):
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if not (isinstance(base, dict) and base):
            return None
        prefix = getattr(model, "base_model_prefix", "")
        nested = isinstance(prefix, str) and prefix and isinstance(getattr(model, prefix, None), nn.Module)
        plan = {f"{prefix}.{key}" if nested else key: style for key, style in base.items()}
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    modules = dict(model.named_modules())
    kept = {}
    for pattern, style in plan.items():
        targets = [module for name, module in modules.items() if matches(pattern, name)]
        if not (targets and all(isinstance(m, nn.Embedding) or m is head for m in targets)):
            kept[str(pattern)] = str(style)
    return kept or None


def largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The name and module of ``model``'s ModuleList with the most parameters (the first of equals), or None."""
    name = outline(model).largest_list()
    return None if name is None else (name, model.get_submodule(name))  # type: ignore[return-value]  # a ModuleList


def matches(pattern: str, name: str) -> bool:
    """Whether a ``parallelize_module`` key names module ``name``: part by part, ``*`` standing for one part."""
    parts, wanted = name.split("."), pattern.split(".")
    return bool(name) and len(parts) == len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))


def near(shape: ModelOutline, pattern: str) -> list[str]:
    """The module names that agree with ``pattern`` on the most leading parts: what the user may have meant."""
    def agreed(name: str) -> int:
        count = 0
        for part, wanted in zip(name.split("."), pattern.split(".")):
            if not fnmatch.fnmatchcase(part, wanted):
                break
            count += 1
        return count

    candidates = [name for name in shape.names if name]
    best = max(map(agreed, candidates), default=0)
    return [name for name in candidates if agreed(name) == best][:_SHOWN]


def unit_names(shape: ModelOutline, units: Sequence[str | type] | None) -> list[str]:
    """The names of the modules FSDP shards as units: the outermost of the given classes, or the largest
    ModuleList's children by default (none: the whole network is one unit). Never the root."""
    if units is None:
        blocks = shape.largest_list()
        return shape.children_of(blocks) if blocks is not None else []
    for wanted in units:
        if not any(name and shape.is_a(name, wanted) for name in shape.names):
            raise ValueError(f"fsdp_units names {_class_name(wanted)}, which no module of the model is: its "
                             f"classes include {', '.join(_classes(shape))}; e.g. fsdp_units={_units_example(shape)}")
    found: list[str] = []
    for name in shape.names:
        inside = any(name.startswith(f"{outer}.") for outer in found)
        if name and not inside and any(shape.is_a(name, wanted) for wanted in units):
            found.append(name)
    return found


def check_fsdp_units(model: nn.Module, fsdp_units: Sequence[str | type] | None) -> None:
    """Every class in ``fsdp_units`` names some module of ``model`` (besides the root)."""
    unit_names(outline(model), fsdp_units)


def check_tp_plan(model: nn.Module, plan: Mapping[str, str | ParallelStyle], tp: int,
                  example: Callable[[], str] | None = None) -> None:
    """Every pattern names a module; colwise/rowwise split Linear or Embedding layers whose split width tp divides.

    ``example``: makes the plan a refusal shows (``torch_support.tp_trial.example_text`` tries it first); by
    default the rule in words."""
    import torch.nn as nn

    shape = outline(model)
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        kind = style_kind(pattern, style)
        named = [name for name in modules if matches(pattern, name)]
        if not named:
            raise ValueError(unmatched(shape, pattern))
        if kind not in ("colwise", "rowwise"):
            continue
        for name in named:
            module = modules[name]
            if isinstance(module, nn.Linear):
                attribute = "out_features" if kind == "colwise" else "in_features"
            elif isinstance(module, nn.Embedding):
                attribute = "embedding_dim" if kind == "colwise" else "num_embeddings"
            else:
                raise ValueError(f'tp_plan splits "{pattern}" {kind}, but {name} is a {type(module).__name__}: '
                                 f"colwise and rowwise split nn.Linear and nn.Embedding layers only; name those, "
                                 f"e.g. tp_plan={example() if example is not None else PLAN_IN_WORDS}")
            width = getattr(module, attribute)
            if width % tp:
                raise ValueError(f"tp={tp} does not divide {name} ({type(module).__name__}): its {kind} split "
                                 f"cuts {attribute}={width}; pick a tp that divides {width}, or leave "
                                 f'"{pattern}" out of tp_plan')


def style_kind(pattern: str, style: object) -> str:
    """colwise, rowwise, sequence, replicate, or other (a torch style that splits no width labkit checks)."""
    if isinstance(style, str):
        if style not in STYLE_KINDS:
            raise ValueError(f'tp_plan gives "{pattern}" the style "{style}", which labkit does not know: use one of '
                             f"{', '.join(STYLE_KINDS)}, or a torch ParallelStyle object")
        return STYLE_KINDS[style]
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    if not isinstance(style, ParallelStyle):
        raise ValueError(f'tp_plan gives "{pattern}" a {type(style).__name__}: give a style name such as '
                         '"colwise" or "rowwise", or a torch ParallelStyle object')
    kinds = ((ColwiseParallel, "colwise"), (RowwiseParallel, "rowwise"), (SequenceParallel, "sequence"))
    return next((kind for cls, kind in kinds if isinstance(style, cls)), "other")


def unmatched(shape: ModelOutline, pattern: str) -> str:
    return (f'tp_plan names "{pattern}", which matches no module of the model (a "*" stands for one part of a '
            f"name): its modules near it are {', '.join(near(shape, pattern))}")


def check_pp_split(model: nn.Module, pp_split: Sequence[str] | None, stages: int) -> None:
    """``stages - 1`` distinct submodule names, in module order: each starts a pipeline stage."""
    if stages <= 1:
        return
    shape = outline(model)
    if pp_split is None:
        raise ValueError(f"pp needs split points for this model: pass pp_split={pp_example(shape, stages)}, or give "
                         "the model a keep_stage(stage, stages) method")
    order = {name: index for index, name in enumerate(shape.names)}
    for name in pp_split:
        if name == "":
            raise ValueError(f'pp_split names the whole model (""): split at submodules, e.g. '
                             f"pp_split={pp_example(shape, stages)}")
        if name not in order:
            raise ValueError(f'pp_split names "{name}", which is no module of the model: split at modules such as '
                             f"{', '.join(_split_candidates(shape)[:_SHOWN * 2])}")
        if list(pp_split).count(name) > 1:
            raise ValueError(f'pp_split names "{name}" twice: each split point starts one stage')
    if len(pp_split) != stages - 1:
        raise ValueError(f"pp={stages} needs {stages - 1} split points, pp_split has {len(pp_split)}: "
                         f"e.g. pp_split={pp_example(shape, stages)}")
    for before, after in zip(pp_split, pp_split[1:]):
        if order[after] < order[before]:
            raise ValueError(f'pp_split must follow the model\'s module order: "{after}" comes before "{before}"; '
                             f"pass pp_split={quoted(sorted(pp_split, key=order.__getitem__))}")


def pp_example(shape: ModelOutline, stages: int) -> str:
    """``stages - 1`` split points spread evenly over the model's blocks (its largest ModuleList's children)."""
    candidates = _split_candidates(shape)
    if len(candidates) < max(stages, 2):
        return quoted(candidates[1:stages])
    return quoted([candidates[round(index * len(candidates) / stages)] for index in range(1, stages)])


def quoted(names: Sequence[str]) -> str:
    """A list of names as the user writes it: ["blocks.2", "blocks.4"]."""
    return "[" + ", ".join(f'"{name}"' for name in names) + "]"


def verify_refusal(model: nn.Module, data_parallel: bool) -> str | None:
    """Why splitting ``model`` cannot train exactly as one process does, or None.

    ``data_parallel``: the step's batch is split (over ranks or micro-batches), which batch norm sees."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    reasons = []
    for name, module in model.named_modules():
        if isinstance(module, _DropoutNd) and module.p > 0:
            reasons.append(f"dropout at {name or 'the model'} (p={module.p}) draws other masks on each rank than "
                           "in one process: build the model with p=0 to verify")
        if data_parallel and isinstance(module, _BatchNorm):
            reasons.append(f"batch norm at {name or 'the model'} ({type(module).__name__}) normalizes by each "
                           "rank's slice of the batch, one process by the whole batch: use LayerNorm or GroupNorm "
                           "to verify")
    config = getattr(model, "config", None)
    for attribute in CONFIG_DROPOUTS:
        value = getattr(config, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            reasons.append(f"the model's config sets {attribute}={value}: dropout draws other masks on each rank "
                           f"than in one process; build it with {attribute}=0.0 to verify")
    return "; ".join(reasons) or None


def _split_candidates(shape: ModelOutline) -> list[str]:
    blocks = shape.largest_list()
    return shape.children_of(blocks) if blocks is not None else shape.children_of("")


def _classes(shape: ModelOutline) -> list[str]:
    return list(dict.fromkeys(cls.__name__ for name, cls in shape.classes.items() if name))[:_SHOWN * 2]


def _units_example(shape: ModelOutline) -> str:
    blocks = shape.largest_list()
    children = shape.children_of(blocks) if blocks is not None else []
    names = [shape.classes[children[0]].__name__] if children else _classes(shape)
    return f'["{names[0]}"]' if names else '["<a block class>"]'


def _class_name(wanted: str | type) -> str:
    return wanted if isinstance(wanted, str) else wanted.__name__
