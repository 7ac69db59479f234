"""The zoo's tiny GPT, declared: its settings, what it costs, the splits it refuses, its data and its loss.

A decoder-only language model (the network, ``labkit.zoo.gpt_network``, built
on the ranks) learning next tokens of ``MarkovText``: sequences from a fixed
sparse Markov chain, each token followed by one of a few likely successors, so
the loss can fall far below log(vocab). Its loss is next-token cross-entropy;
its outputs are class scores, so an ensemble of it votes. Named in labkit's
``pyproject.toml`` as ``gpt = "labkit.zoo.gpt:MODEL"``.

Nothing here imports torch until the ranks build the network, make the data or
compute the loss: the notebook reads the declaration to check a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from labkit.zoo.catalog import ModelDeclaration
from labkit.zoo.stages import Layered

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.zoo.data import MarkovText


@dataclass(frozen=True)
class GPTConfig(Layered):
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


def network(settings: GPTConfig) -> nn.Module:
    from labkit.zoo.gpt_network import TinyGPT

    return TinyGPT(settings)


def data(settings: GPTConfig, seed: int) -> MarkovText:
    from labkit.zoo.data import MarkovText

    return MarkovText(settings.vocab, settings.seq, seed)


def next_token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def tokens_per_sample(settings: GPTConfig) -> int:
    return settings.seq


MODEL = ModelDeclaration(
    "gpt", summary="a tiny GPT-style decoder learning a sparse Markov chain's next tokens", settings=GPTConfig,
    network=network, data=data, loss=next_token_cross_entropy, tokens_per_sample=tokens_per_sample,
    classifies=True, list_position=20,
)
