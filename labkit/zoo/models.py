"""The zoo's registry: model names to classes, and ``build_model`` to make one the same on every rank.

A zoo model is one module in ``labkit/zoo/`` (``mlp.py``, ``gpt.py``) that owns
everything a strategy asks of it: ``keep_stage(stage, stages)`` cuts it to one
pipeline stage, and ``tp_plan(sequence_parallel)`` says how tensor parallelism
shards it. Its settings live in ``labkit.zoo.configs`` (torch-free, so the
notebook can check a request before any rank builds a model); add a model there
and in ``MODEL_CLASSES`` below.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from labkit.zoo.configs import stage_slice
from labkit.zoo.gpt import TinyGPT
from labkit.zoo.mlp import MLP

__all__ = ["MLP", "MODEL_CLASSES", "TinyGPT", "build_model", "stage_slice"]

MODEL_CLASSES = {"mlp": MLP, "gpt": TinyGPT}


def build_model(name: str, config, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The same initial weights on every rank and in the reference: seeded by ``seed``."""
    model_class = MODEL_CLASSES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return model_class(config)
