"""What the training loop, the strategies and the proof of equivalence train: a ``Trainable``.

A trainable says how to build the network (the same initial weights from the
same seed, everywhere), what any step's global batch is (``batches``), how the
network is called on a batch and what the loss of its output is, and what
speaks for the network to the strategies (``plan``, ``zoo.model_protocol``).
Nothing else in a run asks which model it trains, so the zoo's models and a
user's own take the same path:

- ``DeclaredTrainable``: a model of the catalog (``zoo.catalog``): its batches
  are ``(inputs, targets)``, the network is called on the inputs, its
  declared loss compares the output with the targets; the network speaks for
  itself.
- ``OwnTrainable``: what a user brought (``spec.own_model``, built on the rank
  by ``rank.own_model``): their factory, their data (``own_data``), their
  loss (default: cross-entropy, ``batches.default_loss``); a ``ModulePlan``
  speaks for their network where it does not itself (``zoo.own_plan``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.nn as nn

from labkit.torch_support import batches as batch_ops
from labkit.torch_support.loss_check import checked_loss
from labkit.torch_support.own_data import batch_share, batches_for
from labkit.zoo.own_plan import ModulePlan, model_output

if TYPE_CHECKING:
    from labkit.spec.train_config import TrainConfig
    from labkit.zoo.catalog import ModelDeclaration

Batch = Any  # a tensor, or tuples / lists / dicts of them, every leaf with the batch's rows first
Loss = Callable[[Any, Batch], torch.Tensor]  # (the network's output, the batch) -> the mean loss


def watched(trainable: Any, loss: torch.Tensor) -> torch.Tensor:
    """``loss``, shown first to the run's watch on losses (``rank.nonfinite.LossWatch``) while a loop runs."""
    watch = getattr(trainable, "loss_watch", None)
    if watch is not None:
        watch.saw(loss)
    return loss


class Trainable(Protocol):
    name: str
    loss_watch: Any  # while a loop runs, what sees each loss as it is made (``rank.nonfinite.LossWatch``)

    def build(self, seed: int, device: str | torch.device) -> nn.Module:
        """The network, with the same initial weights wherever it is built with ``seed``."""

    def batch(self, step: int, size: int) -> Batch:
        """The whole global batch of step ``step`` (``size`` samples), the same everywhere."""

    def share(self, step: int, size: int, index: int, parts: int) -> Batch:
        """Part ``index`` of ``parts`` of that batch (consecutive rows), made without the rest where it can be."""

    def call(self, module: nn.Module, batch: Batch) -> Any:
        """The network's output on ``batch``."""

    def loss(self, output: Any, batch: Batch) -> torch.Tensor:
        """The mean loss of ``output`` on ``batch``."""

    def plan(self, module: nn.Module, example_rows: tuple[int, int] | None = None) -> object:
        """What speaks for ``module`` to the strategies (``zoo.model_protocol.Model``'s parts it offers).
        ``example_rows``: (global batch, rows of one micro-batch on one rank), when a pipeline is cut by tracing
        the network on an example of its inputs."""

    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample, for a language model (None: its samples are not counted in tokens)."""

    def builds_on_meta(self, parts: tuple[str, ...]) -> bool:
        """Whether the ranks may build the network on the meta device and split it there under the strategy
        ``parts`` (``torch_support.meta_init``): it can be built there, and no part needs its values to split it."""


def seeded_build(make: Callable[[], nn.Module], seed: int, device: str | torch.device) -> nn.Module:
    """``make()`` with torch's generator seeded by ``seed`` (and put back after), on ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return make()


def initial_network(trainable: Trainable, seed: int, device: str | torch.device) -> nn.Module:
    """The network a run starts from, on ``device``: built on the CPU and moved, so a run on a GPU, a split
    given its values by rank 0 (``meta_init``) and the single-process reference all start from the same
    weights."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return trainable.build(seed, device)
    return trainable.build(seed, "cpu").to(device)


class DeclaredTrainable:
    """A model of the catalog under its settings: the zoo's, or an installed package's."""

    loss_watch: Any = None

    def __init__(self, declaration: ModelDeclaration[Any], settings: Any, seed: int) -> None:
        self.declaration, self.settings, self.seed = declaration, settings, seed
        self.name = declaration.name
        self._data = declaration.data(settings, seed)

    def build(self, seed: int, device: str | torch.device) -> nn.Module:
        return self.declaration.build(self.settings, seed, device)

    def batch(self, step: int, size: int) -> Batch:
        return self._data.batch(step, size)

    def share(self, step: int, size: int, index: int, parts: int) -> Batch:
        return batch_share(self._data, step, size, index, parts)

    def call(self, module: nn.Module, batch: Batch) -> Any:
        return module(batch[0])

    def loss(self, output: Any, batch: Batch) -> torch.Tensor:
        return watched(self, checked_loss(self.declaration.loss(output, batch[1]), f"the loss of model {self.name!r}"))

    def plan(self, module: nn.Module, example_rows: tuple[int, int] | None = None) -> object:
        return module

    def tokens_per_sample(self) -> int | None:
        count = self.declaration.tokens_per_sample
        return count(self.settings) if count is not None else None

    def builds_on_meta(self, parts: tuple[str, ...]) -> bool:
        return True  # the catalog's networks build anywhere and cut their own pipeline stages


def declared_trainable(config: TrainConfig) -> DeclaredTrainable:
    """The trainable of a run of a catalog model (a user's own is built on the rank: ``rank.own_model``)."""
    from labkit.zoo.catalog import model

    if config.own is not None:
        raise ValueError(f"{config.own.name} is your own model: the rank builds it from what the notebook sent")
    return DeclaredTrainable(model(config.model), config.model_config, config.seed)


class OwnTrainable:
    """A user's model, data and loss, as each rank built them from what the notebook packed."""

    loss_watch: Any = None

    def __init__(self, name: str, factory: Callable[[], nn.Module], data: Any, loss: Loss | None, seed: int,
                 options: dict, tokens: int | None = None, meta: bool = True, loss_name: str = "") -> None:
        self.name = name
        self.loss_name = loss_name or "the one given"  # how messages name it: its function's name
        self.meta = meta  # the notebook built it on the meta device
        self.factory, self.seed, self.options = factory, seed, options
        self._data = batches_for(data, seed)
        self._loss = loss if loss is not None else batch_ops.default_loss
        self._tokens = tokens

    def build(self, seed: int, device: str | torch.device) -> nn.Module:
        network = seeded_build(self.factory, seed, device)
        if not isinstance(network, nn.Module):
            raise TypeError(f"model={self.name} made a {type(network).__name__}, not a torch.nn.Module: give a class "
                            "or a function with no arguments that returns the network")
        return network

    def batch(self, step: int, size: int) -> Batch:
        return self._data.batch(step, size)

    def share(self, step: int, size: int, index: int, parts: int) -> Batch:
        return batch_share(self._data, step, size, index, parts)

    def call(self, module: nn.Module, batch: Batch) -> Any:
        return batch_ops.call_model(module, batch)

    def loss(self, output: Any, batch: Batch) -> torch.Tensor:
        return watched(self, checked_loss(self._loss(output, batch), f"your loss function ({self.loss_name})"))

    def plan(self, module: nn.Module, example_rows: tuple[int, int] | None = None) -> object:
        options = self.options
        example = self._example_inputs(*example_rows) if example_rows is not None else None
        split = ModulePlan(module, fsdp_units=options.get("fsdp_units"), tp_plan=options.get("tp_plan"),
                           pp_split=options.get("pp_split"), example_inputs=example)
        return OwnPlan(module, split, options)

    def _example_inputs(self, global_batch: int, rows: int) -> tuple | None:
        """The inputs of one micro-batch of ``rows`` samples (its real size: a traced graph may keep the sizes
        it saw); None when the network is called with keywords (a dict batch)."""
        batch = self.share(0, global_batch, 0, global_batch // rows)
        args, kwargs = batch_ops.model_call(batch)
        return tuple(args) if not kwargs else None

    def tokens_per_sample(self) -> int | None:
        return self._tokens

    def builds_on_meta(self, parts: tuple[str, ...]) -> bool:
        if not self.meta:
            return False
        if "pp" not in parts:
            return True
        # A pipeline cut by tracing runs the network on a real example: only a model's own keep_stage cuts on meta.
        own_stage = getattr(seeded_build(self.factory, self.seed, "meta"), "keep_stage", None)
        return callable(own_stage) and not self.options.get("pp_split")


class OwnPlan:
    """What speaks for a user's network: what the user passed to ``lab.train`` first, then the network's own
    methods (``zoo.model_protocol``), then what the ``ModulePlan`` finds by itself.

    Only the parts it offers are attributes, so the strategies' protocol checks see what is there."""

    def __init__(self, module: nn.Module, split: ModulePlan, options: dict) -> None:
        self.module = module
        # A Hugging Face model's ``tp_plan`` is a dict, not a method: the ModulePlan reads that one.
        own_tp = getattr(module, "tp_plan", None)
        self.tp_plan = own_tp if callable(own_tp) and not options.get("tp_plan") else split.tp_plan
        own_units = getattr(module, "fsdp_units", None)
        self.fsdp_units = own_units if callable(own_units) and not options.get("fsdp_units") else split.fsdp_units
        own_stage = getattr(module, "keep_stage", None)
        if callable(own_stage) and not options.get("pp_split"):
            self.keep_stage = own_stage
        else:
            self.split_stage = split.split_stage

    def stage_output(self, output: Any) -> Any:
        """What the whole network returns, from the last pipeline stage's tensors (a traced stage passes only
        tensors: a Hugging Face output arrives as its logits), for the loss."""
        return model_output(self.module, output)
