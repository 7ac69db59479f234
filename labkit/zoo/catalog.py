"""The model catalog: how a model is declared, and the models this process can train.

A model is one declaration, ``ModelDeclaration``, in a module of its own (the
zoo's are ``labkit/zoo/mlp.py`` and ``labkit/zoo/gpt.py``, named below in
``BUILT_IN``); a package of yours names yours by an entry point of the
``labkit.models`` group (``labkit.zoo.plugins``), found in the notebook and on
every rank with no call. A broken one breaks only itself (``model_notes``).

A declaration says, without importing torch: the model's name, its settings (a
frozen dataclass: its fields are what ``model_settings`` may change, with their
defaults; what it costs and which splits it refuses, ``model_protocol``), and
how the ranks make the network, the data and the loss. Those three are plain
functions that import torch when they run, on the ranks, so the notebook can
read every declaration without torch. The network they make offers the
strategies what ``model_protocol.Model`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from labkit.zoo.plugins import PluginError, PluginGroup
from labkit.zoo.setting_values import check_setting_values

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.zoo.model_protocol import Batches

S = TypeVar("S")  # a model's settings class


@dataclass(frozen=True)
class ModelDeclaration(Generic[S]):
    """One model: its name, its settings, and how the ranks make it, its data and its loss."""

    name: str
    summary: str
    settings: type[S]  # a frozen dataclass; ``model_settings=dict(...)`` overrides its fields
    network: Callable[[S], nn.Module]  # the network for these settings (on the ranks: imports torch)
    data: Callable[[S, int], Batches]  # (settings, seed) -> any step's global batch, the same everywhere
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, targets) -> mean loss over the samples
    # Tokens in one sample, for a language model: the report's tokens per second (None: not counted).
    tokens_per_sample: Callable[[S], int] | None = None
    classifies: bool = False  # outputs are class scores (logits): an ensemble votes and scores accuracy
    list_position: int = 100  # where it stands in lists and messages: lower first (then by name)

    def settings_for(self, overrides: dict | None = None) -> S:
        """The settings with ``overrides`` applied; unknown names refused, saying which are known."""
        overrides = dict(overrides or {})
        defaults = {field.name: field.default for field in fields(self.settings)}  # type: ignore[arg-type]
        wrong = sorted(set(overrides) - set(defaults))
        if wrong:
            raise ValueError(f"model {self.name!r} has no setting {', '.join(wrong)}; its settings are "
                             f"{', '.join(sorted(defaults))}")
        check_setting_values(self.name, overrides, defaults)  # a wrong kind named here, not by torch on the ranks
        # A list (JSON, a magic's words) stands for a tuple: settings are frozen, and compared across runs.
        return self.settings(**{key: tuple(value) if isinstance(value, list) else value
                                for key, value in overrides.items()})

    def build(self, settings: S, seed: int, device: str | torch.device = "cpu") -> nn.Module:
        """The network with the same initial weights everywhere (every rank, the reference): seeded by ``seed``."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                return self.network(settings)


# The zoo's models: there wherever labkit is importable, with or without its package metadata.
BUILT_IN = {"mlp": "labkit.zoo.mlp:MODEL", "gpt": "labkit.zoo.gpt:MODEL"}

# What is installed is the process's own: one reader per process, as ``importlib`` keeps one module table.
_MODELS: PluginGroup[ModelDeclaration[Any]] = PluginGroup("labkit.models", "model", ModelDeclaration,
                                                          built_in=BUILT_IN)


def model(name: str) -> ModelDeclaration[Any]:
    """The declaration of model ``name``; PluginError (a ValueError) naming the known models when there is none,
    or saying why an installed one does not load."""
    if not isinstance(name, str) or not _MODELS.knows(name):
        raise PluginError(f"unknown model {name!r}: choose one of {', '.join(_MODELS.names())}."
                         f"{_MODELS.not_loading()} {_MODELS.install_hint()}")
    return _MODELS.get(name)


def model_names() -> tuple[str, ...]:
    """Every model this process can train, in list order (``model_notes``: the installed ones that do not load)."""
    return _MODELS.names()


def model_notes() -> tuple[str, ...]:
    """One line for each installed model that is not used: its error, and what to do."""
    return _MODELS.notes()


def register_model(declaration: ModelDeclaration[Any]) -> None:
    """Use a model declared in a running notebook, in this process (a lesson, a first try).

    An installed package needs no call. One added this way must be added on
    the ranks too (``lab.run(register_model, declaration)``), and its functions
    importable there."""
    _MODELS.add(declaration)


def unregister_model(name: str) -> None:
    """Forget a model ``register_model`` added in this process."""
    _MODELS.remove(name)


def refresh_models() -> None:
    """Read the installed packages again on the next question (after one was uninstalled)."""
    _MODELS.refresh()
