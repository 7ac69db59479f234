"""Settings of the zoo models, without torch: the notebook checks them before ranks build anything.

Each config refuses the splits its model cannot take (``check_tp``,
``check_stages``) with a message that names the shape at fault, so a bad
request fails in the notebook and not as a shape error on some rank. The rule
for which layers a pipeline stage owns (``stage_slice``) lives here too: it is
plain arithmetic on layer names, and the models apply it.

Also what a model costs to train, counted from its settings: parameters, and
model FLOPs per sample (the work the model needs, whatever the strategy; what
model FLOPs utilisation divides by the device's peak).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar


def stage_slice(names: list[str], stage: int, stages: int, invert: bool = False) -> list[str]:
    """The layer names owned by ``stage`` (contiguous, as even as possible), or the others."""
    if not 0 <= stage < stages or stages > len(names):
        raise ValueError(f"cannot split {len(names)} layers into {stages} pipeline stages")
    base, extra = divmod(len(names), stages)
    start = stage * base + min(stage, extra)
    owned = names[start : start + base + (1 if stage < extra else 0)]
    return [name for name in names if name not in owned] if invert else owned


class _Layered:
    """What every zoo config shares: a name in messages, and ``layers`` to split into stages."""

    name: ClassVar[str]
    layers: int

    def check_stages(self, pp: int) -> None:
        """Refuse more pipeline stages than layers: every stage must own at least one."""
        if pp > self.layers:
            raise ValueError(f"pp={pp} stages need at least {pp} layers; {self.name} has {self.layers}")


@dataclass(frozen=True)
class MLPConfig(_Layered):
    name: ClassVar[str] = "mlp"
    dims: tuple[int, ...] = (128, 512, 512, 512, 128)

    @property
    def layers(self) -> int:
        return len(self.dims) - 1

    @property
    def parameters(self) -> int:
        return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(self.dims, self.dims[1:]))

    def training_flops_per_sample(self) -> int:
        # A weight costs 2 FLOPs (multiply, add) per sample forward and 4 backward
        # (the gradient of the input and of the weight): 6 per parameter.
        return 6 * self.parameters

    def check_tp(self, tp: int, sequence_parallel: bool, stages: int = 1) -> None:
        """Refuse, before anything runs, a split that does not divide the widths it shards.

        Each pipeline stage pairs the layers it holds (``MLP.tp_plan``), so under pp the
        pairs start again at every stage's first layer: each stage's pairs are checked."""
        indices = [str(index) for index in range(self.layers)]
        inner = []
        for stage in range(stages):
            owned = [int(name) for name in stage_slice(indices, stage, stages)]
            # Layer i (column-wise) and i+1 (row-wise) both split width dims[i+1].
            inner += [self.dims[owned[k] + 1] for k in range(0, len(owned) - 1, 2)]
        bad = sorted({width for width in inner if width % tp})
        if bad:
            raise ValueError(f"tp={tp} must divide the widths it splits; {bad} do not (MLP dims {self.dims})")
        if sequence_parallel:
            raise ValueError("sequence parallelism applies to the GPT model (its norms and residual stream)")


@dataclass(frozen=True)
class GPTConfig(_Layered):
    name: ClassVar[str] = "gpt"
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def parameters(self) -> int:
        hidden = self.mlp_ratio * self.dim
        block = 4 * self.dim * self.dim + 2 * self.dim * hidden + hidden + self.dim + 2 * 2 * self.dim
        return (self.vocab + self.seq) * self.dim + self.layers * block + 2 * self.dim + self.dim * self.vocab

    def training_flops_per_sample(self) -> int:
        """6 per weight per token, plus attention's scores and weighted sum (PaLM, appendix B).

        Position embeddings are a lookup, not a product, so they are left out;
        attention adds 2 x 2 x seq x dim per layer and token forward, 3x that
        forward and backward. Causal masking is not subtracted (the usual convention).
        """
        weights = self.parameters - self.seq * self.dim
        per_token = 6 * weights + 12 * self.layers * self.dim * self.seq
        return per_token * self.seq

    def check_tp(self, tp: int, sequence_parallel: bool, stages: int = 1) -> None:
        """Refuse, before anything runs, a split that does not divide the heads and widths it shards."""
        # Each rank owns whole heads: a split head would mix ranks inside one softmax.
        if self.heads % tp:
            raise ValueError(f"tp={tp} must divide the number of attention heads ({self.heads})")
        if (self.mlp_ratio * self.dim) % tp:
            raise ValueError(f"tp={tp} must divide the MLP width ({self.mlp_ratio * self.dim})")
        if sequence_parallel and self.seq % tp:
            raise ValueError(f"sequence parallelism needs tp={tp} to divide the sequence length ({self.seq})")


MODELS = {config.name: config for config in (MLPConfig, GPTConfig)}


def model_config(name: str, **overrides):
    """The config of zoo model ``name`` with ``overrides`` applied (unknown keys refused)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    config_class = MODELS[name]
    known = set(asdict(config_class()))
    wrong = sorted(set(overrides) - known)
    if wrong:
        raise ValueError(f"model {name!r} has no setting {', '.join(wrong)}; its settings are {', '.join(sorted(known))}")
    if "dims" in overrides:
        overrides["dims"] = tuple(overrides["dims"])
    return config_class(**overrides)
