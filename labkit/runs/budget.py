"""The per-rank memory budget: estimate on the ranks, refuse in the notebook, say what fits.

The estimate is the parameters this rank would hold under the strategy (the same
TP / PP / FSDP sharding applied to a model on the meta device, which allocates
nothing), plus gradients of the same size, plus the optimizer's states. When a
run does not fit, the refusal names the single-axis sharding strategies that
would, measured the same way on the same ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.spec.errors import LabError
from labkit.spec.train_config import TrainConfig, resolve, user_settings
from labkit.strategies.catalog import sharding_alternatives, strategy
from labkit.units import format_bytes
from labkit.wire.entry import estimate_memory
from labkit.wire.schema import MemoryBytes, total_bytes

if TYPE_CHECKING:
    from labkit.session import Session

# Settings that only mean something to the original run are not carried to the alternatives.
_NOT_CARRIED = ("strategy", "micro_batches", "max_memory")


class MemoryBudgetError(LabError):
    """The model does not fit the per-rank memory budget under the chosen strategy."""


def enforce_budget(session: Session, config: TrainConfig) -> None:
    """Raise ``MemoryBudgetError`` before training if any rank would exceed ``config.max_memory``."""
    estimates = session.run(estimate_memory, config, timeout=session.start_timeout)
    if config.max_memory is None or max(total_bytes(memory) for memory in estimates) <= config.max_memory:
        return
    check_budget(config, estimates, sharded_estimates(session, config))


def sharded_estimates(session: Session, config: TrainConfig) -> dict[str, int]:
    """Largest per-rank bytes of the same model under each single sharding strategy."""
    found = {}
    for name in sharding_alternatives():
        if name == config.strategy:
            continue
        settings = {key: value for key, value in config.as_dict().items()
                    if key in user_settings() and key not in _NOT_CARRIED}
        try:
            alternative = resolve(session.world_size, strategy=name, **settings)
        except ValueError:
            continue  # this model cannot be split that way on these ranks
        try:
            estimates = session.run(estimate_memory, alternative, timeout=session.start_timeout)
        except LabError:
            continue  # a user's own model that this strategy needs more input for (a plan, split points)
        found[name] = max(total_bytes(memory) for memory in estimates)
    return found


def check_budget(config: TrainConfig, estimates: list[MemoryBytes], alternatives: dict[str, int]) -> None:
    """Raise ``MemoryBudgetError`` if any rank's estimate exceeds ``config.max_memory``."""
    worst_rank = max(range(len(estimates)), key=lambda rank: total_bytes(estimates[rank]))
    worst = estimates[worst_rank]
    budget = config.max_memory
    if budget is None or total_bytes(worst) <= budget:
        return
    parts = (
        f"params {format_bytes(worst['params'])} + grads {format_bytes(worst['grads'])} "
        f"+ {config.optimizer} state {format_bytes(worst['optimizer'])}"
    )
    lines = [
        f"{config.model} under {config.strategy} needs {format_bytes(total_bytes(worst))} on rank {worst_rank} "
        f"({parts}), over the budget of {format_bytes(budget)} per rank."
    ]
    if len(config.parts) == 1 and strategy(config.parts[0]).over_budget:
        lines.append(strategy(config.parts[0]).over_budget)  # why more of the same would not fit either
    fitting = {name: size for name, size in alternatives.items() if size <= budget}
    if alternatives:
        told = ", ".join(
            f"{name} {format_bytes(size)}{' (fits)' if name in fitting else ''}" for name, size in alternatives.items()
        )
        lines.append(f"Per rank under sharding strategies on these {len(estimates)} ranks: {told}.")
    if fitting:
        lines.append(f"Use strategy={next(iter(fitting))!r} (or another that fits) to split the model itself.")
    else:
        lines.append(f"Split the model itself ({_either(sharding_alternatives())}), over more ranks, or use a "
                     f"smaller model.")
    raise MemoryBudgetError("\n".join(lines))


def _either(names: tuple[str, ...]) -> str:
    """("fsdp", "tp", "pp") -> "fsdp, tp or pp"."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else "a sharding strategy"
