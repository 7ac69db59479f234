"""A strategy from outside labkit is one module plus one catalog entry (real ranks).

``tests/plugins/local_sgd.py`` wraps the optimizer step and gives ranks roles,
the two plug-in points DiLoCo and a parameter server need.
"""

import pytest

from labkit import LabConfigError
from .plugins import local_sgd

pytestmark = pytest.mark.lab


@pytest.fixture
def registered(lab):
    local_sgd.register_everywhere()
    lab.run(local_sgd.register_everywhere)
    yield
    local_sgd.unregister_everywhere()
    lab.run(local_sgd.unregister_everywhere)


def test_a_plugged_in_optimizer_step_wrapper_trains_like_one_process(lab, registered):
    report = lab.train("local_sgd", "mlp", steps=4, optimizer="sgd", lr=0.05, verify=True, log_every=100)
    assert report.equivalent, str(report)  # sync_every=1 under SGD is synchronous data parallelism
    assert [result["role"] for result in report.results] == ["leader", "follower", "follower", "follower"]


def test_its_setting_is_checked_and_changes_what_it_does(lab, registered):
    with pytest.raises(LabConfigError, match=r"sync_every \(local_sgd\) is a positive integer, got 0"):
        lab.train("local_sgd", "mlp", steps=2, sync_every=0)
    with pytest.raises(LabConfigError, match="sync_every is a setting of local_sgd"):
        lab.train("ddp", "mlp", steps=2, sync_every=2)
    report = lab.train("local_sgd", "mlp", steps=3, optimizer="sgd", lr=0.05, sync_every=2, verify=True,
                       log_every=100)
    assert not report.equivalent  # step 3 was taken alone: the replicas differ from one process
