"""``lab.train(model=MyNet, data=..., loss=...)``: the user's own model, data and loss, packed and checked.

In the notebook, before any rank works:

- **pack** what the user gave (``OwnModel``, ``spec.own_model``): the model (a
  class or a function with no arguments that returns an ``nn.Module``), the
  data (a map-style ``Dataset``, a function ``(step, generator) -> batch``, or
  a function with no arguments that makes either on the ranks), the loss (a
  function ``(output, batch) -> scalar``; default cross-entropy, said once),
  the split options, and every name their code reads from the notebook
  (modules, helper functions and classes, constants), found in its bytecode,
  so a class written in a cell trains with no ``lab.push``. They travel as
  ``lab.push`` sends values (``runs.push``): the notebook's code by source.
- **look** at the model on the meta device (no memory: a model too big for
  one process is still counted) and at one sample of the data: the parameter
  count (memory estimate, MFU), the parameters' names and shapes (what a
  checkpoint must match), tokens per sample.
- **refuse**, once the run's mesh is known (``runs.own_run_checks``), what cannot work,
  saying what to pass: tensor parallelism with no plan, a plan that names no
  module or splits a width tp does not divide; a pipeline with no split points
  or wrong ones; ``fsdp_units`` that match nothing; ``verify`` where the proof
  cannot hold (dropout, batch-norm statistics over several slices).
"""

from __future__ import annotations

import dis
import functools
import hashlib
import sys
import types
from dataclasses import dataclass
from typing import Any

from labkit.runs.push import LAB_NAMES, NOTEBOOK_MODULE, class_statement, from_notebook, pack
from labkit.spec.errors import LabConfigError
from labkit.spec.own_model import OWN_SETTINGS, OwnModel

# Names IPython keeps in the notebook's namespace that user code reading them never means to send.
IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_i", "_ii", "_iii", "_oh", "_dh",
                 "__builtins__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtin__"}
DEFAULT_LOSS = "cross-entropy of the output's logits against the batch's targets (the default)"
EXAMPLE = "lab.train('ddp', model=MyNet, data=train_set, loss=lambda output, batch: F.mse_loss(output, batch[1]))"


@dataclass
class Inspection:
    """What the notebook learned of the user's model and data: kept beside the run's config to check it."""

    network: Any  # the model built on the meta device (no memory)
    sample: Any  # one sample (a batch of one) of the data, or the function's batch of step 0; None: made on ranks
    rows: int | None  # the rows a data function returns per step (its global batch)
    options: dict  # fsdp_units / tp_plan / pp_split as given
    note: str = ""  # what to tell the user once (the default loss)
    samples: int | None = None  # a data set's length (None: a function makes the data)


def split_settings(settings: dict) -> tuple[dict, Inspection | None]:
    """``lab.train``'s settings with the user's own model packed into ``own`` (and ``model`` its name); the
    inspection to check the run with (None for a model of the catalog)."""
    given = {name: settings.pop(name) for name in OWN_SETTINGS if name in settings}
    given = {name: value for name, value in given.items() if value is not None}
    model = settings.get("model")
    if model is None or isinstance(model, str):
        if given:
            named = model or "the default model, mlp"
            raise LabConfigError(f"{', '.join(sorted(given))} describe your own model; {named} is a model of the "
                                 f"zoo, which makes its own data and loss. Pass your model with them "
                                 f"({EXAMPLE}), or drop {', '.join(sorted(given))}")
        return settings, None
    own, inspection = pack_own(model, **given)
    settings["model"], settings["own"] = own.name, own
    if inspection.rows is not None and settings.get("global_batch") is None:
        settings["global_batch"] = inspection.rows  # a data function's batch is the run's
    return settings, inspection


def pack_own(model: Any, data: Any = None, loss: Any = None, fsdp_units: Any = None, tp_plan: Any = None,
             pp_split: Any = None, attention: Any = None) -> tuple[OwnModel, Inspection]:
    """Check and pack the user's model, data, loss and options (``LabConfigError`` saying what to pass)."""
    _check_callable("model", model, "a class or a function with no arguments that returns a torch.nn.Module")
    if data is None:
        raise LabConfigError(f"your own model needs its data: pass data= a map-style Dataset, or a function "
                             f"(step, generator) -> batch. For example: {EXAMPLE}")
    if loss is not None:
        _check_callable("loss", loss, "a function (output, batch) -> a scalar tensor")
    options = _options(fsdp_units, tp_plan, pp_split)
    network = _meta_network(model)
    sample, rows, data_name = _sample(data)
    from labkit.torch_support.batches import tokens_per_sample

    values = {**_names_read(model, data, loss, fsdp_units or ()), "labkit_model": model, "labkit_data": data,
              "labkit_loss": loss, "labkit_options": options}
    try:
        items, sources, said = pack(values, shadows_builtins=True)  # as the code reads them in the notebook
    except LabConfigError as error:
        raise LabConfigError(f"your model, data or loss cannot travel to the ranks: {error}") from None
    name = type(network).__name__
    tokens = tokens_per_sample(sample) if sample is not None else None
    own = OwnModel(
        name=name, data_name=data_name, loss_name=DEFAULT_LOSS if loss is None else _called(loss),
        items=tuple(items), sources=sources, fingerprint=_fingerprint(items), shapes=_shapes(network),
        parameters=sum(p.numel() for p in {id(p): p for p in network.parameters()}.values()),
        tokens_per_sample=tokens, attention=_attention(attention, network, tokens),
        options={key: _in_words(value) for key, value in options.items() if value is not None},
        travelled=tuple((item_name, how) for item_name, how in said if not item_name.startswith("labkit_")),
        meta_build=any(parameter.is_meta for parameter in network.parameters()),
    )
    note = f"labkit: training {name} with the loss {DEFAULT_LOSS}; pass loss=... for another" if loss is None else ""
    samples = len(data) if rows is None and sample is not None else None  # a Dataset: its samples
    return own, Inspection(network, sample, rows, options, note, samples)


# -- what was given ---------------------------------------------------------------


def _check_callable(name: str, value: Any, what: str) -> None:
    if not callable(value):
        raise LabConfigError(f"{name}= is {what}, got a {type(value).__name__}: for example {EXAMPLE}")


def _options(fsdp_units: Any, tp_plan: Any, pp_split: Any) -> dict:
    if fsdp_units is not None:
        fsdp_units = [fsdp_units] if isinstance(fsdp_units, (str, type)) else list(fsdp_units)
        if not all(isinstance(unit, (str, type)) for unit in fsdp_units):
            raise LabConfigError("fsdp_units is a list of module classes (or their names), e.g. "
                                 "fsdp_units=[Block] or fsdp_units=['LlamaDecoderLayer']")
    if tp_plan is not None and not isinstance(tp_plan, dict):
        raise LabConfigError("tp_plan maps module paths to styles, e.g. tp_plan={'blocks.*.q': 'colwise', "
                             "'blocks.*.out': 'rowwise'}")
    if pp_split is not None:
        pp_split = [pp_split] if isinstance(pp_split, str) else list(pp_split)
        if not all(isinstance(point, str) for point in pp_split):
            raise LabConfigError("pp_split is a list of module names where a stage starts, e.g. "
                                 "pp_split=['blocks.4']")
    return {"fsdp_units": fsdp_units, "tp_plan": tp_plan, "pp_split": pp_split}


# The names a Hugging Face config gives a transformer's depth and width (Llama/BERT's, GPT-2's).
CONFIG_SHAPES = (("num_hidden_layers", "hidden_size"), ("n_layer", "n_embd"))


def _attention(given: Any, network: Any, tokens: int | None) -> tuple[int, int] | None:
    """(layers, width) of the model's attention for its FLOPs: given as ``attention=dict(layers=L, dim=d)``, or
    read from a Hugging Face config; None when neither says (the estimate then counts parameters only)."""
    if given is not None:
        layers, width = (given.get("layers"), given.get("dim")) if isinstance(given, dict) else (None, None)
        if not (isinstance(layers, int) and isinstance(width, int) and layers > 0 and width > 0):
            raise LabConfigError("attention is the shape of your transformer's attention, for its FLOPs: "
                                 "attention=dict(layers=12, dim=768)")
        if tokens is None:
            raise LabConfigError("attention is counted per token, and your model's inputs are not token ids "
                                 "(a 2-D integer tensor): drop attention=")
        return layers, width
    config = getattr(network, "config", None)
    for layers_name, width_name in CONFIG_SHAPES:
        layers, width = getattr(config, layers_name, None), getattr(config, width_name, None)
        if isinstance(layers, int) and isinstance(width, int) and tokens is not None:
            return layers, width
    return None


def _in_words(value: Any) -> Any:
    if isinstance(value, list):
        return [item.__name__ if isinstance(item, type) else item for item in value]
    if isinstance(value, dict):
        return {key: style if isinstance(style, str) else type(style).__name__ for key, style in value.items()}
    return value


def _called(function: Any) -> str:
    name = getattr(function, "__name__", type(function).__name__)
    return "a lambda" if name == "<lambda>" else name


def _meta_network(model: Any) -> Any:
    """The model built on the meta device (nothing allocated): its names, shapes and size."""
    import torch

    error: Exception | None = None
    for device in ("meta", "cpu"):  # a model whose building reads its own weights cannot be built on meta
        try:
            with torch.random.fork_rng(devices=[]), torch.device(device):
                network = model()
            break
        except Exception as failure:  # noqa: BLE001 - whatever the user's code raises is theirs, said below
            error = error or failure
    else:
        raise LabConfigError(f"model={_called(model)}() failed in the notebook: {type(error).__name__}: {error}. "
                             f"model= is a class or a function with no arguments that returns the network "
                             f"(model=lambda: MyNet(width=256) for one with arguments)") from None
    if not isinstance(network, torch.nn.Module):
        raise LabConfigError(f"model={_called(model)}() returned a {type(network).__name__}, not a torch.nn.Module: "
                             "give a class or a function with no arguments that returns the network")
    if not any(True for _ in network.parameters()):
        raise LabConfigError(f"{type(network).__name__} has no parameters: there is nothing to train")
    return network


def _sample(data: Any) -> tuple[Any, int | None, str]:
    """(one sample as a batch of one, or a data function's batch of step 0; that function's rows; in words).

    Data made by a function with no arguments is made on the ranks, not here: nothing is looked at."""
    import torch

    from labkit.torch_support.batches import check_batch
    from labkit.torch_support.own_data import DatasetBatches, batches_for, describe_data, is_factory

    if is_factory(data):
        return None, None, f"made on each rank by {_called(data)}()"
    try:
        batches = batches_for(data, seed=0)
    except (TypeError, ValueError) as error:
        raise LabConfigError(f"data=: {error}") from None
    try:
        if isinstance(batches, DatasetBatches):
            from torch.utils.data import default_collate

            sample = default_collate([data[0]])
            check_batch(sample, "your data's sample 0")
            return sample, None, describe_data(data)
        sample = data(0, torch.Generator().manual_seed(0))
        rows = check_batch(sample, "your data function's batch of step 0")
    except (TypeError, ValueError) as error:
        raise LabConfigError(f"data=: {error}") from None
    return sample, rows, describe_data(data)


# -- the names the user's code reads from the notebook ------------------------------------------------


def _names_read(*roots: Any) -> dict:
    """The notebook's names the user's code reads (found in its bytecode), and those their code reads in turn."""
    namespace = _notebook_namespace()
    ipython_own = _ipython_hidden()
    found: dict = {}
    waiting = [root for root in _flattened(roots)]
    seen: set[int] = set()
    while waiting:
        value = waiting.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if not isinstance(value, type) and from_notebook(type(value)):
            waiting.append(type(value))  # an instance of a class written in a cell (a Dataset): its class too
        if not from_notebook(value):
            continue
        for name in _global_names(value):
            if name in found or name in IPYTHON_NAMES or name in LAB_NAMES or name not in namespace:
                continue
            if name in ipython_own and namespace[name] is ipython_own[name]:
                continue  # IPython's own (its open, exit, display): the ranks' builtins stand in its place

            found[name] = namespace[name]
            waiting.append(namespace[name])
        if isinstance(value, type):
            found.setdefault(value.__name__, value)  # a class its instances are pickled by name against
    return found


def _notebook_namespace() -> dict:
    """The names the notebook's cells define: IPython's user namespace in a kernel, else ``__main__``'s."""
    try:
        from IPython import get_ipython
    except ImportError:
        shell = None
    else:
        shell = get_ipython()
    if shell is not None:
        return shell.user_ns
    return vars(sys.modules.get(NOTEBOOK_MODULE, types.ModuleType(NOTEBOOK_MODULE)))


def _ipython_hidden() -> dict:
    """What IPython itself put in the notebook's namespace (its ``open``, ``exit``, ``In``: ``user_ns_hidden``)."""
    from IPython import get_ipython  # a shell, if any, is IPython's

    return dict(getattr(get_ipython(), "user_ns_hidden", None) or {})


def _flattened(roots: tuple) -> list:
    values: list = []
    for root in roots:
        if isinstance(root, (list, tuple)):
            values.extend(root)
        elif isinstance(root, functools.partial):
            values.extend([root.func, *root.args, *root.keywords.values()])
        elif root is not None:
            values.append(root)
    return values


def _global_names(value: Any) -> set[str]:
    """The global names a notebook function or class reads (for a class: its methods' and its statement's)."""
    if isinstance(value, types.FunctionType):
        return _code_globals(value.__code__)
    names: set[str] = set()
    for member in vars(value).values():
        for part in (member, getattr(member, "__func__", None), getattr(member, "fget", None)):
            if isinstance(part, types.FunctionType):
                names |= _code_globals(part.__code__)
    found = class_statement(value)
    if found is not None:
        import ast

        tree = ast.parse(found[2])
        for node in ast.walk(tree):  # bases, decorators, class attributes (methods' bodies read above)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                names.add(node.id)
    return names


def _code_globals(code: types.CodeType) -> set[str]:
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(instruction.argval, str)}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= _code_globals(constant)
    return names


# -- digests ----------------------------------------------------------------------------------------------


def _fingerprint(items: list[dict]) -> str:
    digest = hashlib.sha256()
    for item in sorted(items, key=lambda item: item["name"]):
        digest.update(item["name"].encode())
        for key in ("module", "source", "data"):
            value = item.get(key)
            if value is not None:
                digest.update(value if isinstance(value, bytes) else str(value).encode())
    return digest.hexdigest()[:16]


def _shapes(network: Any) -> str:
    lines = sorted(f"{name}:{tuple(parameter.shape)}" for name, parameter in network.named_parameters())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
