"""How a model's layers are shared out among pipeline stages: plain arithmetic on layer names, no torch.

``stage_slice`` is the rule the zoo's networks apply when a pipeline stage keeps
its layers (``keep_stage``), and the rule their settings check in the notebook
(``check_stages``, ``check_tp`` per stage), so the two never disagree.
"""

from __future__ import annotations

from typing import ClassVar


def stage_slice(names: list[str], stage: int, stages: int, invert: bool = False) -> list[str]:
    """The layer names owned by ``stage`` (contiguous, as even as possible), or the others."""
    if not 0 <= stage < stages or stages > len(names):
        raise ValueError(f"cannot split {len(names)} layers into {stages} pipeline stages")
    base, extra = divmod(len(names), stages)
    start = stage * base + min(stage, extra)
    owned = names[start : start + base + (1 if stage < extra else 0)]
    return [name for name in names if name not in owned] if invert else owned


class Layered:
    """Settings of a model made of ``layers`` layers: a name for messages, and the stages it can be cut into.

    Its whole-number settings are sizes and counts (widths, heads, layers, vocabulary): each at least 1."""

    name: ClassVar[str]
    layers: int

    def __post_init__(self) -> None:
        # Called by the dataclass's __init__: a size of 0 or below would only fail later, inside torch on the ranks.
        for name, value in vars(self).items():
            sizes = value if isinstance(value, tuple) else (value,)
            if any(isinstance(size, int) and not isinstance(size, bool) and size < 1 for size in sizes):
                raise ValueError(f"model {self.name!r}: setting {name} is a size, each at least 1, got {value!r}; "
                                 f"e.g. {name}={getattr(type(self), name, value)!r}")

    def check_stages(self, stages: int) -> None:
        """Refuse more pipeline stages than layers: every stage must own at least one."""
        if stages > self.layers:
            raise ValueError(f"pp={stages} stages need at least {stages} layers; {self.name} has {self.layers}")
