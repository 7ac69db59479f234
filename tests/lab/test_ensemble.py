"""Ensembles on real ranks: members trained apart on the queue, scored against their combination."""

import numpy
import pytest

from labkit import LabConfigError
from labkit.runs.ensemble import combine_members, member_specs, vote

from labkit.zoo.configs import model_config


def test_specs_vary_what_they_say_and_refuse_nonsense():
    by_seed = member_specs("gpt", 3, 5, "seed", 0.01, 7, 32, 2, "adamw", {})
    assert [spec["seed"] for spec in by_seed] == [7, 8, 9] and {spec["lr"] for spec in by_seed} == {0.01}
    assert {spec["data_seed"] for spec in by_seed} == {7}  # the same data for all
    by_lr = member_specs("gpt", 3, 5, "lr", 0.01, 7, 32, 2, "adamw", {})
    assert [spec["lr"] for spec in by_lr] == pytest.approx([0.005, 0.01, 0.02])
    assert {spec["seed"] for spec in by_lr} == {7}
    for wrong, match in [(dict(members=0), "members"), (dict(vary="colour"), "vary"), (dict(lr=-1), "lr"),
                         (dict(optimizer="lion"), "optimizer"), (dict(model_settings={"depth": 3}), "no setting")]:
        arguments = dict(model="gpt", members=2, steps=5, vary="seed", lr=0.01, seed=0, global_batch=32,
                         heldout_batches=2, optimizer="adamw", model_settings={})
        arguments.update(wrong)
        with pytest.raises(LabConfigError, match=match):
            member_specs(**arguments)


def test_a_vote_is_the_majority_and_a_tie_goes_to_the_averaged_probability():
    # Three members, two positions, three classes.
    first = numpy.array([[0.6, 0.3, 0.1], [0.1, 0.5, 0.4]])
    second = numpy.array([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]])
    third = numpy.array([[0.1, 0.8, 0.1], [0.3, 0.1, 0.6]])
    predictions = [first, second, third]
    averaged = sum(predictions) / 3
    assert vote(predictions, averaged).tolist() == [0, 2]  # 2 of 3 chose class 0, then class 2
    tie = [first[:1], third[:1]]  # one vote each for classes 0 and 1; class 1 has more averaged mass
    assert vote(tie, sum(tie) / 2).tolist() == [1]


def test_combining_scores_members_and_the_ensemble_on_the_same_targets():
    targets = numpy.array([0, 1, 2, 1])
    member = lambda index, rows: {"member": index, "seed": index, "lr": 0.1, "rank": index, "losses": [1.0],
                                  "predictions": numpy.eye(3)[rows] * 0.9 + 0.1 / 3, "targets": targets,
                                  "weights": {}}
    report = combine_members([member(1, [0, 1, 0, 1]), member(0, [0, 0, 2, 1]), member(2, [2, 1, 2, 0])],
                             "gpt", "seed", "vote")
    assert [m["member"] for m in report.members] == [0, 1, 2]  # back in member order
    assert [m["score"] for m in report.members] == [0.75, 0.75, 0.5]
    assert report.ensemble == {"mean": 1.0, "vote": 1.0} and report.score == 1.0
    assert "ensemble (majority vote): 100.0%" in repr(report)


@pytest.mark.lab
def test_members_train_apart_and_are_combined(lab):
    report = lab.ensemble("gpt", members=4, steps=4, heldout_batches=1, global_batch=8)
    assert [member["member"] for member in report.members] == [0, 1, 2, 3]
    assert len({member["seed"] for member in report.members}) == 4
    assert all(0.0 <= member["score"] <= 1.0 for member in report.members)
    assert set(report.ensemble) == {"mean", "vote"}
    assert report.tasks.done == 4 and sum(report.tasks.per_rank().values()) == 4
    # The weights came back, one full set per member, and the members differ.
    config = model_config("gpt")
    assert len(report.weights) == 4 and report.weights[0].keys() == report.weights[1].keys()
    name = next(iter(report.weights[0]))
    assert not numpy.array_equal(report.weights[0][name], report.weights[1][name])
    assert report.members[0]["loss"] < numpy.log(config.vocab) + 0.5


@pytest.mark.lab
def test_a_regression_ensemble_beats_its_members_and_a_vote_is_refused(lab):
    report = lab.ensemble("mlp", members=4, steps=30)
    assert report.metric == "mse" and set(report.ensemble) == {"mean"}
    assert report.score < report.best_member  # averaging the members' errors away
    with pytest.raises(LabConfigError, match="nothing to vote on"):
        lab.ensemble("mlp", members=2, steps=2, combine="vote")
