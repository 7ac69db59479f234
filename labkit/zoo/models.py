"""Build any model by name, the same on every rank: ``build_model("gpt", settings, seed)``.

A model is its declaration (``labkit.zoo.catalog``): the zoo's ``mlp`` and
``gpt``, or an installed package's. This module keeps the names people import
from here: the zoo's networks, and ``stage_slice``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from labkit.zoo.catalog import model
from labkit.zoo.gpt_network import TinyGPT
from labkit.zoo.mlp_network import MLP
from labkit.zoo.stages import stage_slice

__all__ = ["MLP", "TinyGPT", "build_model", "stage_slice"]


def build_model(name: str, config: Any, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The same initial weights on every rank and in the reference: seeded by ``seed``."""
    return model(name).build(config, seed, device)
