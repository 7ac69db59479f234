"""Settings of the zoo models, without torch: the notebook checks them before ranks build anything."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MLPConfig:
    dims: tuple[int, ...] = (128, 512, 512, 512, 128)

    @property
    def layers(self) -> int:
        return len(self.dims) - 1


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
