"""Ensembles: several models trained apart, their predictions combined.

``run_ensemble(session, model, members=4, steps=..., vary="seed")`` trains each
member alone on one rank (``rank.ensemble.train_member``), through the lab's
work-stealing queue (``runs.tasks``): an idle rank takes the next member, and a
member whose rank dies is trained again elsewhere. The members never
communicate while they train; the only traffic is their predictions coming
back, which is why the seeds call ensembles the communication-light extreme.

Diversity: ``vary="seed"`` gives member i the seed ``seed + i`` (its own
initial weights); ``vary="lr"`` gives every member the same initial weights and
learning rates spread by factors of two around ``lr``. Every member sees the
same full data.

Combining, on held-out batches nobody trained on:

- the GPT predicts a next token, a classification: each member's accuracy, the
  ensemble's by averaged probabilities (``"mean"``) and by majority vote of the
  members' choices (``"vote"``, ties going to the class with the larger
  averaged probability);
- the MLP is a regression: each member's mean squared error and the averaged
  prediction's (a vote has no meaning there and is refused).

The notebook side combines with numpy only; the members' weights come back as
numpy arrays in ``EnsembleReport.weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy

from labkit.runs.tasks import run_tasks
from labkit.spec.bounds import (MAX_GLOBAL_BATCH, MAX_LR, MAX_LR_MEMBERS, MAX_MEMBERS_PER_RANK, MAX_STEPS, check_lr,
                                check_whole, largest_member_lr, lr_spread)
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import OPTIMIZERS
from labkit.wire import entry
from labkit.zoo.catalog import model as declared_model
from labkit.zoo.catalog import model_names
from labkit.zoo.configs import model_config

if TYPE_CHECKING:  # the session is a layer above the runs it drives
    from labkit.session import Session

VARIES = ("seed", "lr")
COMBINES = ("mean", "vote")


def member_specs(model: str, members: int, steps: int, vary: str, lr: float, seed: int, global_batch: int,
                 heldout_batches: int, optimizer: str, model_settings: dict, ranks: int = 1) -> list[dict]:
    """What each member trains, checked before any rank works; ``ranks``: how many ranks share the members."""
    for name, value in (("members", members), ("steps", steps), ("global_batch", global_batch),
                        ("heldout_batches", heldout_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LabConfigError(f"{name} is a positive integer, got {value!r}")
    most = MAX_MEMBERS_PER_RANK * ranks  # each rank trains its members one after another
    check_whole("members", members, most, f"members=4 (at most {MAX_MEMBERS_PER_RANK} per rank: {most} on "
                                          f"{ranks} rank{'s' if ranks != 1 else ''})")
    check_whole("steps", steps, MAX_STEPS, "steps=30")
    check_whole("global_batch", global_batch, MAX_GLOBAL_BATCH, "global_batch=32")
    if vary not in VARIES:
        raise LabConfigError(f"vary is 'seed' (each member its own initial weights) or 'lr' (learning rates "
                             f"spread around lr), got {vary!r}")
    check_lr("lr", lr, "lr=3e-3")
    if vary == "lr":
        check_whole("members", members, MAX_LR_MEMBERS, "members=5 with vary='lr' (their learning rates double "
                    f"from one to the next: {MAX_LR_MEMBERS} already span 2**{MAX_LR_MEMBERS - 1})")
        if largest_member_lr(lr, members) > MAX_LR:
            raise LabConfigError(f"with vary='lr' the largest of {members} members' learning rates is lr x "
                                 f"{lr_spread(members):g} = {largest_member_lr(lr, members):g}, above {MAX_LR:g}: "
                                 f"give a smaller lr (at most {MAX_LR / lr_spread(members):.3g}) or fewer members")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63 - members:
        raise LabConfigError(f"seed is a non-negative integer, got {seed!r}")
    if optimizer not in OPTIMIZERS:
        raise LabConfigError(f"unknown optimizer {optimizer!r}: choose {', '.join(OPTIMIZERS)}")
    try:
        model_config(model, **(model_settings or {}))
    except (TypeError, ValueError) as error:
        raise LabConfigError(str(error)) from None
    specs = []
    for member in range(members):
        spread = 2.0 ** (member - (members - 1) / 2) if vary == "lr" else 1.0  # bounded above
        specs.append({
            "member": member, "model": model, "model_settings": dict(model_settings or {}), "steps": steps,
            "global_batch": global_batch, "heldout_batches": heldout_batches, "optimizer": optimizer,
            "lr": float(lr) * spread, "seed": seed + member if vary == "seed" else seed, "data_seed": seed,
        })
    return specs


def _accuracy(choices, targets) -> float:
    return float((choices == targets).mean())


def vote(predictions: list, averaged) -> "numpy.ndarray":
    """The class most members chose at each position; ties go to the larger averaged probability."""
    classes = averaged.shape[-1]
    counts = sum(numpy.eye(classes, dtype=numpy.float64)[p.argmax(-1)] for p in predictions)
    # A tie in votes is broken by the averaged probability (always below 1, so it never outweighs a vote).
    return (counts + averaged).argmax(-1)


@dataclass
class EnsembleReport:
    """Members' scores against the ensemble's, on the same held-out data."""

    model: str
    vary: str
    combine: str
    members: list[dict]  # member, seed, lr, rank, final loss, held-out score
    metric: str  # "accuracy" (higher is better) or "mse" (lower is better)
    ensemble: dict[str, float]  # "mean" (and "vote" for a classifier) -> the ensemble's score
    weights: list[dict] = field(default_factory=list, repr=False)
    tasks: object = field(default=None, repr=False)

    @property
    def score(self) -> float:
        return self.ensemble[self.combine]

    @property
    def best_member(self) -> float:
        scores = [member["score"] for member in self.members]
        return max(scores) if self.metric == "accuracy" else min(scores)

    def _format(self, value: float) -> str:
        return f"{value:.1%}" if self.metric == "accuracy" else f"{value:.4f}"

    def __repr__(self) -> str:
        what = "held-out accuracy" if self.metric == "accuracy" else "held-out MSE"
        lines = [f"ensemble of {len(self.members)} {self.model} members (vary {self.vary})",
                 f"{'member':<8}{'seed':<6}{'lr':<10}{'rank':<6}{'final loss':<12}{what}"]
        for member in self.members:
            lines.append(f"{member['member']:<8}{member['seed']:<6}{member['lr']:<10.3g}{member['rank']:<6}"
                         f"{member['loss']:<12.4f}{self._format(member['score'])}")
        names = {"mean": "averaged probabilities" if self.metric == "accuracy" else "averaged prediction",
                 "vote": "majority vote"}
        for how, value in self.ensemble.items():
            lines.append(f"ensemble ({names[how]}): {self._format(value)}")
        lines.append(f"best single member: {self._format(self.best_member)}")
        return "\n".join(lines)


def combine_members(results: list[dict], model: str, vary: str, combine: str, tasks=None) -> EnsembleReport:
    """Score every member and the ensemble on the held-out batches (numpy only)."""
    results = sorted(results, key=lambda result: result["member"])
    targets = results[0]["targets"]
    predictions = [result["predictions"] for result in results]
    averaged = sum(predictions) / len(predictions)
    members = []
    classifies = declared_model(model).classifies
    for result, prediction in zip(results, predictions):
        if classifies:
            score = _accuracy(prediction.argmax(-1), targets)
        else:
            score = float(((prediction - targets) ** 2).mean())
        members.append({"member": result["member"], "seed": result["seed"], "lr": result["lr"],
                        "rank": result["rank"], "loss": result["losses"][-1], "score": score})
    if classifies:
        ensemble = {"mean": _accuracy(averaged.argmax(-1), targets),
                    "vote": _accuracy(vote(predictions, averaged), targets)}
    else:
        ensemble = {"mean": float(((averaged - targets) ** 2).mean())}
    return EnsembleReport(model, vary, combine, members, "accuracy" if classifies else "mse", ensemble,
                          weights=[result["weights"] for result in results], tasks=tasks)


def run_ensemble(session: Session, model: str = "gpt", members: int = 4, steps: int = 30, vary: str = "seed",
                 combine: str = "mean", lr: float = 3e-3, seed: int = 0, global_batch: int = 32,
                 heldout_batches: int = 4, optimizer: str = "adamw", model_settings: dict | None = None,
                 timeout: float | None = None, retries: int | None = None, live: bool | None = None,
                 sites: dict | None = None
                 ) -> EnsembleReport:
    """Train ``members`` models apart on the lab's ranks and combine them; see the module docstring."""
    if not isinstance(model, str):
        raise LabConfigError(f"lab.ensemble trains the catalog's models ({', '.join(model_names())}) by name; your "
                             f"own model trains with lab.train(strategy, model=..., data=...)")
    if combine not in COMBINES:
        raise LabConfigError(f"combine is 'mean' (averaged probabilities) or 'vote' (majority), got {combine!r}")
    if combine == "vote" and not declared_model(model).classifies:
        voters = [name for name in model_names() if declared_model(name).classifies]
        raise LabConfigError(f"{model} is a regression: there is nothing to vote on. Use combine='mean', "
                             f"or a model that classifies ({', '.join(voters)})")
    ranks = session.world_size + sum(site.world_size for site in (sites or {}).values())
    specs = member_specs(model, members, steps, vary, lr, seed, global_batch, heldout_batches, optimizer,
                         model_settings or {}, ranks)
    tasks = run_tasks(session, entry.train_member, specs, timeout=timeout, retries=retries, live=live, sites=sites)
    return combine_members(tasks.values, model, vary, combine, tasks)
