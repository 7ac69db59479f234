"""The per-rank memory budget: estimate on the ranks, refuse in the notebook, say what fits.

The estimate is the parameters this rank would hold under the strategy (the same
TP / PP / FSDP sharding applied to a model on the meta device, which allocates
nothing), plus gradients of the same size, plus the optimizer's states. When a
run does not fit, the refusal names the single-axis sharding strategies that
would, measured the same way on the same ranks.
"""

from __future__ import annotations

from .errors import LabError
from .train_config import TrainConfig, format_bytes, resolve

# Strategies a refusal may suggest; settings that only mean something to the original are dropped.
SHARDING_ALTERNATIVES = ("fsdp", "tp", "pp")
_NOT_CARRIED = ("strategy", "mesh_names", "mesh_shape", "mesh_reason", "max_memory", "sequence_parallel")


class MemoryBudgetError(LabError):
    """The model does not fit the per-rank memory budget under the chosen strategy."""


def total_bytes(memory: dict) -> int:
    return memory["params"] + memory["grads"] + memory["optimizer"]


def enforce_budget(lab, config) -> None:
    """Raise ``MemoryBudgetError`` before training if any rank would exceed ``config.max_memory``."""
    from .train import estimate_memory

    estimates = lab.run(estimate_memory, config, timeout=lab.start_timeout)
    if max(total_bytes(memory) for memory in estimates) <= config.max_memory:
        return
    check_budget(config, estimates, sharded_estimates(lab, config))


def sharded_estimates(lab, config) -> dict[str, int]:
    """Largest per-rank bytes of the same model under each single sharding strategy."""
    from .train import estimate_memory

    found = {}
    for name in SHARDING_ALTERNATIVES:
        if name == config.strategy:
            continue
        settings = {key: value for key, value in config.as_dict().items() if key not in _NOT_CARRIED}
        if name == "pp":
            settings["micro_batches"] = max(settings["micro_batches"], lab.world_size)
        try:
            alternative = resolve(lab.world_size, strategy=name, **settings)
        except ValueError:
            continue  # this model cannot be split that way on these ranks
        estimates = lab.run(estimate_memory, alternative, timeout=lab.start_timeout)
        found[name] = max(total_bytes(memory) for memory in estimates)
    return found


def check_budget(config: TrainConfig, estimates: list[dict], alternatives: dict[str, int]) -> None:
    """Raise ``MemoryBudgetError`` if any rank's estimate exceeds ``config.max_memory``."""
    worst_rank = max(range(len(estimates)), key=lambda rank: total_bytes(estimates[rank]))
    worst = estimates[worst_rank]
    if total_bytes(worst) <= config.max_memory:
        return
    parts = (
        f"params {format_bytes(worst['params'])} + grads {format_bytes(worst['grads'])} "
        f"+ {config.optimizer} state {format_bytes(worst['optimizer'])}"
    )
    lines = [
        f"{config.model} under {config.strategy} needs {format_bytes(total_bytes(worst))} on rank {worst_rank} "
        f"({parts}), over the budget of {format_bytes(config.max_memory)} per rank."
    ]
    if config.dp_kind == "ddp" and set(config.parts) == {"ddp"}:
        lines.append(
            "Data parallelism keeps a whole copy of the model, its gradients and optimizer state on "
            "every rank: adding ranks never makes it fit."
        )
    fitting = {name: size for name, size in alternatives.items() if size <= config.max_memory}
    if alternatives:
        told = ", ".join(
            f"{name} {format_bytes(size)}{' (fits)' if name in fitting else ''}" for name, size in alternatives.items()
        )
        lines.append(f"Per rank under sharding strategies on these {len(estimates)} ranks: {told}.")
    if fitting:
        lines.append(f"Use strategy={next(iter(fitting))!r} (or another that fits) to split the model itself.")
    else:
        lines.append("Split the model itself (fsdp, tp or pp), over more ranks, or use a smaller model.")
    raise MemoryBudgetError("\n".join(lines))
