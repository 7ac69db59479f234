"""``OwnModel``: a model, data and loss the user brought to ``lab.train``, as a run's settings carry them.

The notebook packs what the user gave (``runs.own_model``): their model class or
factory, their data, their loss, the names their code reads from the notebook,
and the options that say how the strategies split it (``fsdp_units``,
``tp_plan``, ``pp_split``). What travels is the packed form ``runs.push`` makes
for ``lab.push`` (the notebook's classes and functions by source, the rest
pickled); each rank builds it (``rank.own_model``).

A ``TrainConfig`` holds one in ``own`` (``None``: a model of the catalog). It
is compared by what was packed (``fingerprint``): running the cell that defines
the model again, unchanged, is the same model, so ``resume=True`` still
continues. A checkpoint records its ``identity`` instead (the name and the
parameters' names and shapes), which is what loading it needs to match.

Pure: no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The settings that describe the user's own model (given to ``lab.train`` beside ``model``).
OWN_SETTINGS = ("data", "loss", "fsdp_units", "tp_plan", "pp_split", "attention")


@dataclass(frozen=True, eq=False)
class OwnModel:
    """A user's model, data and loss, packed for the ranks, with what the notebook learned of them."""

    name: str  # how messages and the report name it (the class or factory's name)
    data_name: str  # the data, in words ("TensorDataset of 1,797 samples")
    loss_name: str  # the loss, in words ("cross-entropy (the default)")
    items: tuple[dict, ...] = ()  # what each rank builds (``runs.push.pack``'s items)
    sources: dict = field(default_factory=dict)  # {cell: lines}: tracebacks on the ranks show the user's cells
    fingerprint: str = ""  # a digest of everything packed: equal for the same model, data, loss and options
    shapes: str = ""  # a digest of the parameters' names and shapes: what a checkpoint must match
    parameters: int = 0  # counted in the notebook, on a copy of the model on the meta device
    tokens_per_sample: int | None = None  # a language model's sequence length (inputs are 2-D integer ids)
    options: dict = field(default_factory=dict)  # fsdp_units / tp_plan / pp_split as given, in words
    travelled: tuple[tuple[str, str], ...] = ()  # (name, how) of what went with it from the notebook
    attention: tuple[int, int] | None = None  # (layers, width) of a transformer's attention: counted in its FLOPs
    meta_build: bool = True  # it builds on the meta device, so a sharding strategy splits it there first

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnModel) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __deepcopy__(self, memo: dict) -> OwnModel:
        return self  # immutable once packed

    def __repr__(self) -> str:
        return f"OwnModel({self.name!r}, data={self.data_name!r}, loss={self.loss_name!r})"

    @property
    def identity(self) -> dict:
        """What a checkpoint records of it, and loading one compares."""
        return {"name": self.name, "shapes": self.shapes}

    def training_flops_per_sample(self) -> int:
        """Six FLOPs per parameter per token (per sample, for data that is not tokens): forward 2, backward 4;
        with ``attention`` (layers L, width d) also attention's scores and mixing, 12 L d T per token of a
        T-token sequence (the count of the PaLM paper's appendix B).

        Without it a parameter-only estimate: attention's own work and convolutions' reuse of weights are not
        counted."""
        tokens = self.tokens_per_sample or 1
        flops = 6 * self.parameters * tokens
        if self.attention is not None and self.tokens_per_sample:
            layers, width = self.attention
            flops += 12 * layers * width * tokens * tokens
        return flops
