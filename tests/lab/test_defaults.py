"""Every strategy and composition runs with only --strategy and --model given (4 real ranks).

The defaults must run as they are: pipeline microbatches come from the number
of stages, a composition without --mesh takes the most even split of the ranks
that the model allows (or the lab's mesh when its axes fit) and says which.
Only ``--steps`` is shortened, to keep the suite quick; it does not change
whether a run can start.
"""

import math

import pytest

from tests.conftest import lab_shell

from labkit import LabConfigError
from labkit.strategies.catalog import compositions

pytestmark = pytest.mark.lab

STRATEGIES = compositions(4)  # every strategy and composition the catalog allows on 4 ranks


@pytest.fixture(scope="module")
def shell():
    with lab_shell("4 --backend gloo --threads 1 --timeout 120") as ip:
        yield ip


@pytest.mark.parametrize("model", ("mlp", "gpt"))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_defaults_alone_run(shell, capsys, strategy, model):
    report = shell.run_line_magic("lab", f"train --strategy {strategy} --model {model} --steps 2")
    assert report.steps_done == 2
    assert all(math.isfinite(loss) for loss in report.losses)
    said = capsys.readouterr().out
    if "+" in strategy:
        assert f"{strategy} without a mesh: using " in said and "most even split of 4 ranks" in said
        assert report.config.mesh.world_size == 4 and len(report.config.mesh_names) == 2
    if "pp" in strategy:
        assert report.config.micro_batches == report.config.axis("pp")


def test_a_composition_takes_the_labs_mesh_when_its_axes_fit(shell, capsys):
    shell.run_line_magic("lab", "mesh tp=2 dp=2")
    report = shell.run_line_magic("lab", "train --strategy fsdp+tp --model gpt --steps 1")
    assert "using tp=2 x dp=2, the lab's mesh" in capsys.readouterr().out
    assert report.config.mesh_names == ("tp", "dp")


def test_bf16_trains_on_cpu_ranks_and_tf32_is_refused_there(shell):
    report = shell.run_line_magic("lab", "train --strategy fsdp --model gpt --steps 3 --precision bf16")
    assert "in bf16" in report.config.describe() and all(math.isfinite(loss) for loss in report.losses)
    assert report.mfu is None  # no peak for a CPU
    with pytest.raises(LabConfigError, match="tf32 switches NVIDIA GPUs"):
        shell.run_line_magic("lab", "train --strategy ddp --model gpt --steps 1 --tf32")
    with pytest.raises(LabConfigError, match="strict float32"):
        shell.run_line_magic("lab", "train --strategy ddp --model gpt --steps 1 --precision bf16 --verify")
