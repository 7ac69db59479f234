"""The model zoo: a small MLP and a tiny GPT-style decoder, both built to be split.

Both models keep their repeated layers in an ``nn.ModuleDict`` keyed "0", "1", ...
so that a pipeline stage can drop the layers it does not own and every parameter
keeps its name (``blocks.2.attn.q.weight`` is the same tensor on one machine and
on stage 1 of 2). That is what lets a distributed run be compared, parameter by
parameter, with single-process training.

Shapes are written so tensor parallelism can shard them: attention infers its
local head count from the width of its (possibly column-sharded) projections.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model_configs import GPTConfig, MLPConfig


class MLP(nn.Module):
    """Linear layers with ReLU between them; regression on (batch, dims[0]) inputs."""

    def __init__(self, config: MLPConfig = MLPConfig()) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(config.dims[i], config.dims[i + 1]) for i in range(config.layers)}
        )
        self.last_layer = str(config.layers - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if name != self.last_layer:
                x = F.relu(x)
        return x

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop every layer not owned by pipeline ``stage`` of ``stages``."""
        for name in stage_slice(list(self.layers), stage, stages, invert=True):
            del self.layers[name]


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(projection: torch.Tensor) -> torch.Tensor:
            # -1: under tensor parallelism a rank holds only its share of the heads.
            return projection.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.down = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only language model: embed, blocks, final norm, head to logits.

    On a pipeline stage that is not first, ``embed`` is None and the input is the
    previous stage's hidden states; on a stage that is not last, ``norm`` and
    ``head`` are None and the output is hidden states.
    """

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def keep_stage(self, stage: int, stages: int) -> None:
        for name in stage_slice(list(self.blocks), stage, stages, invert=True):
            del self.blocks[name]
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.norm = None
            self.head = None


def stage_slice(names: list[str], stage: int, stages: int, invert: bool = False) -> list[str]:
    """The layer names owned by ``stage`` (contiguous, as even as possible), or the others."""
    if not 0 <= stage < stages or stages > len(names):
        raise ValueError(f"cannot split {len(names)} layers into {stages} pipeline stages")
    base, extra = divmod(len(names), stages)
    start = stage * base + min(stage, extra)
    owned = names[start : start + base + (1 if stage < extra else 0)]
    return [name for name in names if name not in owned] if invert else owned


MODEL_CLASSES = {"mlp": MLP, "gpt": TinyGPT}


def build_model(name: str, config, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The same initial weights on every rank and in the reference: seeded by ``seed``."""
    model_class = MODEL_CLASSES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return model_class(config)
