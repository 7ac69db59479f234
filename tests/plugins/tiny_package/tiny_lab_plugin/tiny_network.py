"""The tiny MLP's network, built on the ranks (with torch)."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyNet(nn.Module):
    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(features, width)
        self.outer = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))

    def fsdp_units(self) -> list[nn.Module]:
        return [self.inner, self.outer]
