"""Settings of the zoo models, without torch: the notebook checks them before ranks build anything.

Also what a model costs to train, counted from its settings: parameters, and
model FLOPs per sample (the work the model needs, whatever the strategy; what
model FLOPs utilisation divides by the device's peak).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MLPConfig:
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


@dataclass(frozen=True)
class GPTConfig:
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


MODELS = {"mlp": MLPConfig, "gpt": GPTConfig}


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
