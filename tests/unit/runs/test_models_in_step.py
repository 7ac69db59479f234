"""After failed work every rank puts its models back in step (runs.recovery.models_in_step): each rank is
asked once, those that ran the work as such, and what could not be done is said with what to do."""

from types import SimpleNamespace

from labkit.runs.recovery import models_in_step
from labkit.spec.errors import LabError


class Ranks:
    """A session's ``call``, answering ``put_models_in_step`` with ``answers`` per rank."""

    def __init__(self, answers: dict, fail: bool = False):
        self.world_size, self.start_timeout, self.answers, self.fail, self.asked = len(answers), 5.0, answers, fail, []

    def call(self, ranks, entry, args, timeout):
        if self.fail:
            raise LabError("rank 1 did not answer within 5 s")
        self.asked.append((list(ranks), args))
        return [self.answers[rank] for rank in ranks]


def test_the_ranks_that_ran_the_work_and_the_others_are_each_asked_once_and_nothing_is_said():
    session = Ranks({0: ["kept"], 1: ["backward forgotten"], 2: []})
    assert models_in_step(session, SimpleNamespace(ranks=[1])) == ""
    assert session.asked == [([1], (True,)), ([0, 2], (False,))]


def test_an_fsdp_model_this_torch_cannot_reset_is_named_with_what_to_do():
    session = Ranks({0: ["Net: left as it was (this torch cannot reset it)"], 1: ["Net: iteration reset"]})
    said = models_in_step(session, SimpleNamespace(ranks=[0, 1]))
    assert said.startswith("; Net (FSDP2) could not be put back in step") and "re-create it on every rank" in said


def test_ranks_that_cannot_be_asked_are_said_with_what_to_do():
    said = models_in_step(Ranks({0: [], 1: []}, fail=True), SimpleNamespace(ranks=[0, 1]))
    assert "could not be put back in step (rank 1 did not answer within 5 s)" in said and "lab.load" in said
