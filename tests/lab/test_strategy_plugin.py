"""A strategy and a model from a separately installed package train and verify on real ranks, with no call.

``tests/plugins/tiny_package`` declares local SGD and a two-layer MLP by entry
points only. It is built and installed into a temporary folder, which is put on
the lab's ``PYTHONPATH`` before its ranks start and on this process's
``sys.path``; nothing registers either one, in the notebook or on the ranks.
The package is gone again after the module (the folder removed, the catalogs
read afresh): nothing of it is left in the environment.
"""

import os
import shutil

import pytest

from labkit import LabConfigError
from labkit.spec.errors import RankFailure
from labkit.strategies.catalog import strategy_names
from labkit.zoo.catalog import model_names

from tests.conftest import started_lab
from tests.plugins.installed import install_tiny_package, on_path

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_plugin")
    site = install_tiny_package(folder)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(site), before)))  # for the ranks started next
    try:
        with on_path(site):
            yield site
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
        shutil.rmtree(folder)  # uninstalled: the package was never in the environment, and now is nowhere


@pytest.fixture(scope="module")
def lab(installed):
    # This module's own lab: its ranks start after the package is on their path.
    with started_lab(4) as running:
        yield running


def found_on_the_rank() -> tuple[bool, bool]:
    from labkit.strategies.catalog import strategy_names
    from labkit.zoo.catalog import model_names

    return "local_sgd" in strategy_names(), "tiny_mlp" in model_names()


def test_both_sides_find_the_package_with_no_registration(lab):
    assert "local_sgd" in strategy_names() and "tiny_mlp" in model_names()
    assert lab.run(found_on_the_rank) == [(True, True)] * 4


def test_the_plugged_in_strategy_and_model_train_like_one_process(lab):
    report = lab.train("local_sgd", "tiny_mlp", steps=4, optimizer="sgd", lr=0.05, verify=True, log_every=100)
    assert report.equivalent, str(report)  # sync_every=1 under SGD is synchronous data parallelism
    assert report.verify["model_moved"] > 1e-3
    assert [result["role"] for result in report.results] == ["leader", "follower", "follower", "follower"]


def test_the_plugged_in_model_trains_under_a_builtin_strategy(lab):
    report = lab.train("fsdp", "tiny_mlp", steps=3, model_settings=dict(width=16), verify=True, log_every=100)
    assert report.equivalent, str(report)


def test_the_strategys_setting_is_checked_and_changes_what_it_does(lab):
    with pytest.raises(LabConfigError, match=r"sync_every \(local_sgd\) is a positive integer, got 0"):
        lab.train("local_sgd", "tiny_mlp", steps=2, sync_every=0)
    with pytest.raises(LabConfigError, match="sync_every is a setting of local_sgd"):
        lab.train("ddp", "mlp", steps=2, sync_every=2)
    report = lab.train("local_sgd", "mlp", steps=3, optimizer="sgd", lr=0.05, sync_every=2, verify=True,
                       log_every=100)
    assert not report.equivalent  # step 3 was taken alone: the replicas differ from one process


def test_what_the_model_does_not_offer_is_refused_saying_what_to_add(lab):
    with pytest.raises(RankFailure, match=r"no tensor-parallel plan for TinyNet: give it a tp_plan"):
        lab.train("tp", "tiny_mlp", steps=1, log_every=100)
