"""The zoo's settings by name, without torch: ``model_config("gpt", dim=128)``.

Each model's settings live with its declaration (``labkit.zoo.mlp``,
``labkit.zoo.gpt``); this module finds any model's by name, through the model
catalog, and keeps the names people import from here.
"""

from __future__ import annotations

from typing import Any

from labkit.zoo.catalog import model
from labkit.zoo.gpt import GPTConfig
from labkit.zoo.mlp import MLPConfig
from labkit.zoo.stages import stage_slice

__all__ = ["GPTConfig", "MLPConfig", "model_config", "stage_slice"]


def model_config(name: str, **overrides: Any) -> Any:
    """The settings of model ``name`` with ``overrides`` applied (unknown models and settings refused)."""
    return model(name).settings_for(overrides)
