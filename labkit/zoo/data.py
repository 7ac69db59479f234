"""Deterministic offline data: every rank can make any step's global batch by itself.

Each model's declaration says which of these it trains on (``labkit.zoo.mlp``,
``labkit.zoo.gpt``); ``dataset_for`` and ``loss_function`` find them by name.

Nothing is downloaded. A batch is a pure function of (seed, step), so every rank
builds the same global batch and takes its own slice, and the single-process
reference trains on exactly the same samples. Both tasks have structure to learn:

- ``TeacherRegression`` (for the MLP): targets from a fixed random two-layer
  network, so the loss can go well below that of predicting zeros;
- ``MarkovText`` (for the GPT): token sequences from a fixed sparse Markov chain,
  each token followed by one of a few likely successors, so next-token loss can
  fall far below log(vocab).
"""

from __future__ import annotations

import torch

from labkit.zoo.catalog import model


def _generator(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + salt)


class TeacherRegression:
    def __init__(self, in_dim: int, out_dim: int, seed: int = 0, hidden: int = 64) -> None:
        g = _generator(seed, -1)
        self.in_dim = in_dim
        self.seed = seed
        self.w1 = torch.randn(in_dim, hidden, generator=g) / in_dim**0.5
        self.w2 = torch.randn(hidden, out_dim, generator=g) / hidden**0.5

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both contiguous: (size, in_dim) and (size, out_dim)."""
        x = torch.randn(size, self.in_dim, generator=_generator(self.seed, step))
        return x, torch.tanh(x @ self.w1) @ self.w2


class MarkovText:
    def __init__(self, vocab: int, seq: int, seed: int = 0, successors: int = 3) -> None:
        g = _generator(seed, -1)
        self.vocab, self.seq, self.seed = vocab, seq, seed
        weights = torch.zeros(vocab, vocab)
        for token in range(vocab):
            likely = torch.randperm(vocab, generator=g)[:successors]
            weights[token, likely] = torch.rand(successors, generator=g) + 0.5
        self.transitions = (weights + 0.01) / (weights + 0.01).sum(dim=1, keepdim=True)
        self._cumulative = self.transitions.cumsum(dim=1)

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (size, seq) token ids, contiguous; targets are inputs shifted by one.

        Each next token is drawn by inverse transform: one uniform number per
        position, looked up in the cumulative row of the current token. The
        positions must follow one another, but each is one cheap lookup for the
        whole batch (a tenth of ``torch.multinomial``'s time), so a GPU's step
        is not left waiting for its data.
        """
        g = _generator(self.seed, step)
        tokens = torch.empty(size, self.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (size,), generator=g)
        uniform = torch.rand(self.seq, size, 1, generator=g)
        for position in range(1, self.seq + 1):
            rows = self._cumulative[tokens[:, position - 1]]
            drawn = torch.searchsorted(rows, uniform[position - 1]).squeeze(1)
            tokens[:, position] = drawn.clamp_(max=self.vocab - 1)  # a draw above the row's rounded total
        # Copies, not views: a strided tensor goes to a GPU through a temporary (verify's and DiLoCo's
        # ``.to(device)``). The two copies take about 10 us together, beside about 1 ms of draws at the
        # default settings: no difference measurable in the whole call.
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def dataset_for(model_name: str, config, seed: int):
    """Model ``model_name``'s data for its settings ``config`` (its declaration says which)."""
    return model(model_name).data(config, seed)


def loss_function(model_name: str):
    """Model ``model_name``'s mean loss over the samples given (MSE for the MLP, next-token cross-entropy
    for the GPT)."""
    return model(model_name).loss
