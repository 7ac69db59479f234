"""What speaks to the strategies for a user's own network: ``ModulePlan``, made from names the user passed.

``lab.train(model=MyNet, fsdp_units=["Block"], tp_plan={"blocks.*.attn.q": "colwise", ...},
pp_split=["blocks.2"])``: a network the zoo does not know offers none of the
``zoo.model_protocol`` methods, so a ``ModulePlan`` offers them for it:

- ``fsdp_units()``: the outermost modules of the given classes; by default the
  children of the largest ``nn.ModuleList`` (a transformer's blocks), or none.
- ``tp_plan(sequence_parallel)``: the user's plan, else the one a Hugging Face
  model publishes (``hf_tp_plan``), with style names made torch styles.
- ``split_stage(stage, stages)``: an arbitrary module cannot cut itself down
  (``keep_stage``), so torch's tracer cuts it (``torch.distributed.pipelining``,
  with ``torch.export``) at the ``pp_split`` modules, on one example micro-batch.

The traced stages keep every parameter's name, and this module makes them fit
labkit's pipeline: each stage takes exactly what the one before returns (torch
hands a value the third stage needs straight from the first; here the middle
stage carries it), and the Linear and Embedding layers are the original modules
again, which tensor parallelism splits (torch's styles refuse the traced
stand-ins). A stage carries its whole network's outline
(``own_checks.ModelOutline``), so a ``ModulePlan`` made for the stage still
knows the classes and names the tracer replaced. Limits of the tracing:

- the pipeline passes tensors only: the last stage returns the model's outputs
  flat (a Hugging Face ``ModelOutput`` as its logits); ``model_output`` rebuilds
  what the model returns; a Hugging Face model is traced with ``use_cache=False``
  (``without_cache``): its key/value cache is no tensor;
- a graph keeps the sizes it saw: it runs micro-batches of the example's shape,
  and tensor parallelism on a stage works only where the forward reads widths
  from the tensors (``view(B, T, -1, head)``): a size written into the graph
  (Llama's key/value heads) stays the whole model's;
- cut before tensor parallelism: ``torch.export`` cannot trace DTensor parameters.

The notebook-side checks of the same names are in ``own_checks``.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from labkit.zoo.own_checks import (
    check_fsdp_units, check_pp_split, check_tp_plan, hf_tp_plan, largest_module_list, matches, outline, pp_example,
    PLAN_IN_WORDS, quoted, style_kind, unit_names, unmatched, verify_refusal,
)

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.pipelining import Pipe
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.fx import Graph, GraphModule, Node
    from torch.utils._pytree import TreeSpec

# The notebook's checks are ``own_checks``'; they are named here too, so one module answers for own models.
__all__ = ["ModulePlan", "caching_configs", "check_fsdp_units", "check_pp_split", "check_tp_plan", "hf_tp_plan",
           "largest_module_list", "model_output", "torch_style", "verify_refusal", "without_cache"]


class ModulePlan:
    """Speaks for ``model`` to the strategies by the names the user gave (see the module docstring)."""

    def __init__(self, model: nn.Module, fsdp_units: Sequence[str | type] | None = None,
                 tp_plan: Mapping[str, str | ParallelStyle] | None = None, pp_split: Sequence[str] | None = None,
                 example_inputs: tuple | None = None) -> None:
        self.model = model
        self.outline = outline(model)
        self._units = None if fsdp_units is None else list(fsdp_units)
        self._plan = None if tp_plan is None else dict(tp_plan)
        self._split = None if pp_split is None else list(pp_split)
        self._example = example_inputs
        self._cut: tuple[int, list[nn.Module], TreeSpec | None, bool] | None = None  # one trace serves every stage

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP shards one at a time, of those the model holds now (never the root)."""
        modules = dict(self.model.named_modules())
        return [modules[name] for name in unit_names(self.outline, self._units) if name in modules]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """The plan as torch styles (``parallelize_module``'s keys), each naming modules the model holds now (a
        stage: its own); the replicated entries left out.

        ``sequence_parallel`` needs the plan itself to shard something by sequence: only it knows the layouts."""
        plan = self._plan or self.outline.hf_plan
        if not plan:
            raise ValueError(f"tp needs a plan for this model: pass tp_plan={PLAN_IN_WORDS}")
        here = [name for name, _ in self.model.named_modules()]
        styles: dict[str, ParallelStyle] = {}
        for pattern, style in plan.items():
            made = torch_style(pattern, style)
            if not any(matches(pattern, name) for name in self.outline.names):
                raise ValueError(unmatched(self.outline, pattern))
            if made is not None and any(matches(pattern, name) for name in here):
                styles[pattern] = made
        if sequence_parallel and not any(style_kind(key, style) == "sequence" for key, style in plan.items()):
            raise ValueError('sequence_parallel for your own model comes from its plan: give its norms the style '
                             '"sequence" (e.g. tp_plan={"blocks.*.norm": "sequence", ...}) with the layouts around '
                             "them as torch styles, or leave sequence_parallel off")
        return styles

    def split_stage(self, stage: int, stages: int) -> nn.Module:
        """The module of pipeline ``stage`` of ``stages``, cut by tracing the model on the example inputs."""
        if self._split is None:
            raise ValueError(f"pp needs split points for this model: pass pp_split={pp_example(self.outline, stages)}"
                             ", or give the model a keep_stage(stage, stages) method")
        check_pp_split(self.model, self._split, stages)
        if stages == 1:
            return self.model
        if self._example is None:
            raise ValueError("pp cuts this model by tracing its forward on an example micro-batch, and there is none: "
                             "call the model with positional tensors (not a dict batch), or give the model a "
                             "keep_stage(stage, stages) method")
        if self._cut is None or self._cut[0] != stages:
            pipe, output_spec = _trace(self.model, tuple(self._example), self._split)
            if pipe.num_stages != stages:
                raise ValueError(f"pp_split={quoted(self._split)} cut the traced forward into {pipe.num_stages} "
                                 f"stages, not {stages}: each split point must be a module the forward calls, in "
                                 "that order")
            cut = [pipe.get_stage_module(index) for index in range(stages)]
            self._cut = (stages, cut, output_spec, _chain(pipe, cut))
        _, parts, output_spec, returned = self._cut
        part = parts[stage]
        if stage == stages - 1 and output_spec is not None and not output_spec.is_leaf() and returned:
            setattr(part, "labkit_output_spec", output_spec)  # for model_output
        _restore_layers(part, self.model)
        setattr(part, "labkit_outline", self.outline)  # a plan made for the stage reads the whole network's
        return part


def model_output(stage: nn.Module, output: Any) -> Any:
    """What the whole model returns, rebuilt from its last traced stage's ``output``: torch's pipeline passes
    only tensors, so that stage returns the model's outputs flat (a Hugging Face ``ModelOutput`` becomes its
    logits tensor). Any other output as it is."""
    import torch.utils._pytree as pytree

    spec = getattr(stage, "labkit_output_spec", None)
    if spec is None:
        return output
    return pytree.tree_unflatten(list(output) if isinstance(output, (tuple, list)) else [output], spec)


def torch_style(pattern: str, style: str | ParallelStyle) -> ParallelStyle | None:
    """The torch style for a plan entry; None for the replicated ones ("replicate", "local", "gather").

    Names mean what they mean to Hugging Face: "colwise_rep" and "colwise_gather_output" gather the output
    (``ColwiseParallel(output_layouts=Replicate())``); "rowwise_rep" and "rowwise_split_input" take a whole
    input and split it themselves (``RowwiseParallel(input_layouts=Replicate())``), as "embedding_rowwise" takes
    whole token ids; "embedding_colwise" gathers its vectors; "sequence" is torch's ``SequenceParallel()``."""
    kind = style_kind(pattern, style)
    if not isinstance(style, str):
        return style
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if kind == "colwise":
        return ColwiseParallel(output_layouts=Replicate())
    if kind == "rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    return SequenceParallel() if kind == "sequence" else None


def _trace(model: nn.Module, example: tuple, split: list[str]) -> tuple[Pipe, TreeSpec | None]:
    """torch's pipeline of ``model`` cut before each ``split`` module, and the structure of the model's output."""
    import torch.utils._pytree as pytree
    from torch.distributed.pipelining import SplitPoint, pipeline

    specs: list[TreeSpec] = []
    hook = model.register_forward_hook(lambda module, args, output: specs.append(pytree.tree_flatten(output)[1]))
    try:
        with warnings.catch_warnings(), without_cache(model):  # torch's own use of a deprecated pytree name, on every trace
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            pipe = pipeline(model, mb_args=example, split_spec={name: SplitPoint.BEGINNING for name in split})
    except Exception as error:
        cause = str(error.__cause__ or error).strip().splitlines()
        raise ValueError(f"pp traces the forward with torch.export to cut it, and the trace failed: "
                         f"{cause[0][:400] if cause else type(error).__name__}. Make the forward traceable, "
                         "or give the model a keep_stage(stage, stages) method") from error
    finally:
        hook.remove()
        for name in split:  # torch marks the split points by replacing their forward: put it back
            module = model.get_submodule(name)
            original = vars(module).pop("_orig_forward", None)
            vars(module).pop("forward", None)
            if original is not None and getattr(original, "__func__", None) is not type(module).forward:
                vars(module)["forward"] = original  # the module's own instance-level forward
    return pipe, specs[-1] if specs else None


def caching_configs(model: nn.Module) -> list[Any]:
    """The configs of a Hugging Face model (``config``, ``generation_config``) that ask it to return its
    key/value cache: a cache object, not a tensor, so no pipeline can pass it. Duck-typed."""
    found = []
    for name in ("config", "generation_config"):
        settings = getattr(model, name, None)
        if settings is not None and getattr(settings, "use_cache", None) is True:
            found.append(settings)
    return found


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``use_cache=False`` on ``model``'s configs while it is traced, as they were afterwards: the config object
    may be shared with the namespace it was built from, where other runs read it."""
    turned = caching_configs(model)
    for settings in turned:
        settings.use_cache = False
    try:
        yield
    finally:
        for settings in turned:
            settings.use_cache = True


def _chain(pipe: Pipe, parts: list[nn.Module]) -> bool:
    """Make each stage take exactly what the stage before returns, in order (the middle ones carry what a later
    stage needs from an earlier one). Returns whether the last stage returns the model's outputs in order."""
    root = pipe.split_gm
    stage_of: dict[Node, int] = {}
    for node in root.graph.nodes:
        if node.op == "call_module":
            called = root.get_submodule(node.target)
            stage_of.update({node: index for index, part in enumerate(parts) if part is called})

    def source(node: Node) -> tuple[int, Any]:  # (stage, which of its outputs); stage -1: the model's inputs
        if node in stage_of:
            return stage_of[node], None
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in stage_of:
            return stage_of[node.args[0]], node.args[1]  # type: ignore[index]
        if node.op == "placeholder":
            return -1, node.target
        raise ValueError(f"pp cannot pass {node.name} ({node.op}) between traced stages: give the model a "
                         "keep_stage(stage, stages) method")

    calls = {index: node for node, index in stage_of.items()}
    last = len(parts) - 1
    needs = [source(arg) for arg in calls[last].args]  # type: ignore[arg-type]
    for index in range(last - 1, -1, -1):
        part: GraphModule = parts[index]  # type: ignore[assignment]  # torch's stages are GraphModules
        graph = part.graph
        own = [source(arg) for arg in calls[index].args]  # type: ignore[arg-type]
        inputs = [node for node in graph.nodes if node.op == "placeholder"]
        result = _output(graph).args[0]
        values = []
        for wanted in needs:
            if wanted in own:
                values.append(inputs[own.index(wanted)])
            elif wanted[0] == index:
                values.append(result if wanted[1] is None else result[wanted[1]])  # type: ignore[index]
            elif index == 0:
                raise ValueError(f"a later pipeline stage reads the model's input {wanted[1]} that the first stage "
                                 "does not take: give the model a keep_stage(stage, stages) method")
            else:
                with graph.inserting_before(next(node for node in graph.nodes if node.op != "placeholder")):
                    inputs.append(graph.placeholder(f"carried_{len(inputs)}"))
                own.append(wanted)
                values.append(inputs[-1])
        _output(graph).args = (values[0] if len(values) == 1 else tuple(values),)
        graph.lint()
        part.recompile()
        needs = own
    flat = _output(root.graph).args[0]
    sources = [source(node) for node in (flat if isinstance(flat, (tuple, list)) else [flat])]  # type: ignore[arg-type]
    result = _output(parts[last].graph).args[0]  # type: ignore[arg-type]
    keys = [None] if not isinstance(result, (tuple, list)) else list(range(len(result)))
    if any(stage != last for stage, _ in sources):
        raise ValueError("the model returns a value that an earlier pipeline stage computes: return only what its "
                         "last layers compute, or give the model a keep_stage(stage, stages) method")
    return [key for _, key in sources] == keys


def _output(graph: Graph) -> Node:
    return next(node for node in reversed(graph.nodes) if node.op == "output")


def _restore_layers(part: nn.Module, model: nn.Module) -> None:
    """Put the model's own Linear and Embedding layers back where the tracer left stand-ins that take their one
    input: the same parameters, and what torch's colwise and rowwise styles accept."""
    from torch import nn

    originals = dict(model.named_modules())
    for name, module in list(part.named_modules()):
        original = originals.get(name)
        graph = getattr(module, "graph", None)
        if (name and module is not original and isinstance(original, (nn.Linear, nn.Embedding)) and graph is not None
                and sum(node.op == "placeholder" for node in graph.nodes) == 1):
            part.set_submodule(name, original)
