"""The defaults run on a lab whose size is not a power of two (3 real gloo ranks, as after a
joined machine is dropped): the default global batch is rounded to what the ranks split, and
the run says so once."""

import math

import pytest

from labkit import LabConfigError

from tests.conftest import started_lab

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def three():
    with started_lab(3, timeout=60) as lab:
        yield lab


@pytest.mark.parametrize("strategy, batch, note", [
    ("ddp", 33, "global batch 33 (32 rounded up to a multiple of 3 data-parallel ranks)"),
    ("fsdp", 33, "global batch 33 (32 rounded up to a multiple of 3 data-parallel ranks)"),
    ("pp", 33, "global batch 33 (32 rounded up to a multiple of 3 micro-batches)"),
    ("diloco", 33, "global batch 33 (32 rounded up to a multiple of 3 data-parallel ranks)"),
])
def test_the_defaults_train_on_three_ranks(three, capsys, strategy, batch, note):
    report = three.train(strategy, "mlp", steps=3, log_every=100)
    assert report.steps_done == 3 and all(math.isfinite(loss) for loss in report.losses)
    assert report.config.global_batch == batch
    said = capsys.readouterr().out
    assert said.count(note) == 1, said


def test_a_batch_given_that_does_not_split_is_refused_with_the_nearest(three):
    with pytest.raises(LabConfigError, match="use a multiple of 3, such as 30 or 33"):
        three.train("ddp", "mlp", steps=1, global_batch=32)
    with pytest.raises(LabConfigError, match="run on a lab of 2 or 4 ranks"):
        three.train("tp", "mlp", steps=1)
