"""``lab.train(model=MyNet, ...)``'s refusals once the run's mesh is known, and the notes said once of a run.

``runs.own_model`` packed the user's model and looked at it (``Inspection``);
``check_run`` reads that against the run's strategy and mesh, before any rank
works, and raises ``LabConfigError`` saying what to pass: an option no part of
the strategy reads (``tp_plan`` given to ddp), tensor parallelism with no plan
or a plan that does not fit the model (a pattern that names no module, a width
tp does not divide, layers that fail together on the meta device:
``torch_support.tp_trial``, which also makes the plan a refusal suggests), a
pipeline with no split points or wrong ones, ``fsdp_units`` that match nothing,
``verify`` where the proof cannot hold. What the lab changes for the run (a
Hugging Face model's cache, off while a pipeline is cut) it says once
(``say_once``).
"""

from __future__ import annotations

from typing import Any

from labkit.runs.own_model import Inspection
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import TrainConfig


HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head")  # a Hugging Face config's heads


def _check_heads(network: Any, tp: int) -> None:
    """Attention heads split whole over tensor-parallel ranks: a Hugging Face config's counts must divide."""
    settings = getattr(network, "config", None)
    for name in HEAD_COUNTS:
        count = getattr(settings, name, None)
        if isinstance(count, int) and count % tp:
            raise ValueError(f"tp={tp} splits attention heads whole, and the model's config has {name}={count}: "
                             f"use a tp size that divides {count}, or a config whose {name} tp divides")


def _refuse_unread(options: dict, parts: tuple[str, ...]) -> None:
    """An option of the user's model that no part of the run reads (``tp_plan`` given to ddp) is refused: it
    would be dropped without a word. Its owners are named as ``spec.train_config`` names a strategy setting's."""
    from labkit.strategies.catalog import strategy, strategy_names
    from labkit.zoo.plugins import PluginError

    for name, value in options.items():
        if value is None or any(name in strategy(part).model_options for part in parts):
            continue
        owners = []
        for candidate in strategy_names():
            try:
                entry = strategy(candidate)
            except PluginError:  # a broken plugin answers for itself when it is asked for
                continue
            if name in entry.model_options:
                owners.append(entry)
        if not owners:
            raise LabConfigError(f"{name} is read by no installed strategy: drop {name}")
        whose = " or ".join(f"{owner.name} ({owner.summary})" for owner in owners)
        add = " or ".join(owner.name for owner in owners)
        raise LabConfigError(f"{name} is a setting of {whose}: add {add} to the strategy, or drop {name}")


def _check_tp(inspection: Inspection, tp: int) -> None:
    """A plan is there, names the model's modules, splits widths tp divides; a plan the user gave runs on the
    meta device (``torch_support.tp_trial``). Refusals show a plan that ran there."""
    from labkit.torch_support import tp_trial
    from labkit.zoo import own_plan

    network, sample, plan = inspection.network, inspection.sample, inspection.options["tp_plan"]

    def example() -> str:
        return tp_trial.example_text(network, sample, tp)

    if plan is None and not callable(getattr(network, "tp_plan", None)):
        plan = own_plan.hf_tp_plan(network)
        if plan is None:
            raise ValueError(f"tp needs a plan for this model: pass tp_plan={example()}")
    if plan is not None:
        own_plan.check_tp_plan(network, plan, tp, example)
    _check_heads(network, tp)
    given = inspection.options["tp_plan"]
    if given is None or sample is None:
        return  # a model's own plan is its author's; data made on the ranks cannot be tried here
    try:
        failure = tp_trial.plan_failure(network, sample, given, tp)
    except tp_trial.Untried:
        return
    if failure is not None:
        raise ValueError(f"tp_plan does not fit together: one rank's slice of {type(network).__name__} fails on the "
                         f"meta device with {failure.rstrip('.')}. Layers that read the same input are split colwise side by "
                         f"side, the one that reads their outputs rowwise: e.g. tp_plan={example()}")


def check_run(inspection: Inspection, config: TrainConfig) -> list[str]:
    """Refuse, before any rank works, what the run's strategy cannot do with this model, saying what to pass.

    Returns what to tell the user once of the run (a setting the lab changes for it), for ``say_once``."""
    from labkit.zoo import own_plan

    network, options, parts = inspection.network, inspection.options, config.parts
    notes: list[str] = []
    _refuse_unread(options, parts)
    try:
        if options["fsdp_units"] and "fsdp" in parts:
            own_plan.check_fsdp_units(network, options["fsdp_units"])
        if "tp" in parts:
            _check_tp(inspection, config.axis("tp"))
        if "pp" in parts:
            if options["pp_split"] or not callable(getattr(network, "keep_stage", None)):
                own_plan.check_pp_split(network, options["pp_split"], config.axis("pp"))
                if "tp" in parts:
                    raise ValueError("pp cuts your model into stages by tracing its forward, which cannot follow "
                                     "tensor-parallel parameters: train it under pp or tp (or fsdp+pp, ddp+pp, "
                                     "fsdp+tp), or give the model a keep_stage(stage, stages) method for pp+tp")
                if own_plan.caching_configs(network):
                    notes.append(f"labkit: {type(network).__name__} is cut into pipeline stages with use_cache=False "
                                 "(its key/value cache is no tensor a pipeline passes); its config is left as it is")
            if isinstance(inspection.sample, dict):
                raise ValueError("a pipeline passes tensors from stage to stage: give batches as (inputs, targets) "
                                 "tuples, not dicts, to train under pp")
        if config.verify:
            slices = config.data_parts * (config.micro_batches or 1)
            refusal = own_plan.verify_refusal(network, data_parallel=slices > 1)
            if refusal:
                raise ValueError(f"verify=True cannot hold for {network.__class__.__name__}: {refusal}")
    except ValueError as error:
        raise LabConfigError(str(error)) from None
    if inspection.samples is not None and config.global_batch > inspection.samples:
        # Each step would read the data set more than once, and make every rank collate its share of it.
        raise LabConfigError(f"global_batch={config.global_batch} is more samples than your data set has "
                             f"({inspection.samples:,}): pass a global_batch of at most {inspection.samples:,}")
    if inspection.rows is not None and inspection.rows != config.global_batch:
        raise LabConfigError(f"your data function returns {inspection.rows} rows per step, and the run's global "
                             f"batch is {config.global_batch}: pass global_batch={inspection.rows}, or make the "
                             f"function return {config.global_batch}")
    return notes


def say_once(said: set[str], notes: list[str]) -> None:
    """Print each of ``notes`` not in ``said`` (the session's: notes told once, not at every run), and add it."""
    for note in notes:
        if note and note not in said:
            said.add(note)
            print(note, flush=True)
