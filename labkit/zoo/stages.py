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
    """Settings of a model made of ``layers`` layers: a name for messages, and the stages it can be cut into."""

    name: ClassVar[str]
    layers: int

    def check_stages(self, stages: int) -> None:
        """Refuse more pipeline stages than layers: every stage must own at least one."""
        if stages > self.layers:
            raise ValueError(f"pp={stages} stages need at least {stages} layers; {self.name} has {self.layers}")
