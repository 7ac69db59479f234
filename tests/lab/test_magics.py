"""%lab and %%lab through IPython's own shell, on a real 2-rank lab."""

import pytest

from labkit.spec.errors import LabConfigError
from IPython.core.error import UsageError

from labkit import DeviceError, Lab, MeshError, RankFailure

from tests.conftest import ipython_shell

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def shell():
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "labkit")
    yield ip
    ip.run_line_magic("unload_ext", "labkit")


@pytest.fixture(scope="module")
def started(shell):
    shell.run_line_magic("lab", "start 2 --backend gloo --threads 1 --timeout 20")
    yield shell
    shell.run_line_magic("lab", "stop")


def test_cell_magic_without_a_lab_says_how_to_start(shell):
    with pytest.raises(UsageError, match="%lab start"):
        shell.run_cell_magic("lab", "", "print(rank)")


BAD_STARTS = [  # (%lab line, the error it raises, what the message says)
    ("start 0", DeviceError, "at least 1"),
    ("start 2 --launcher mpich", LabConfigError, "unknown launcher 'mpich': choose one of .*mpi.*slurm"),
    ("start 2 --launcher mpi --launcher-option mpi_argz=[]", LabConfigError,
     "the mpi launcher has no option mpi_argz; its options are: .*mpi_args"),
    ("start 2 --launcher mpi --launcher-option mpi_args", UsageError, "expected KEY=VALUE"),
    ("start 2 --controller-address nowhere", LabConfigError, "controller_address is an IPv4 address"),
    ("start 2 --controller-address 203.0.113.7", LabConfigError, "203.0.113.7 is not an address of this machine"),
    ("start 2 --interface eth99", LabConfigError, "no IPv4 interface 'eth99'"),
    ("start 2 --backend nccl", DeviceError, "nccl needs GPUs"),
    ("start 2 --backend mpi", UsageError, "^--backend: unknown backend 'mpi'; choose gloo or nccl "
                                          "\\(see %lab start --help\\)$"),
    ("launch 2", UsageError, "^unknown command 'launch'; the commands: start, mesh, "),
]


def printed_lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_help_of_a_command_is_its_options_one_line_each_and_nothing_else(shell, capsys):
    assert shell.run_line_magic("lab", "kill --help") is None
    assert printed_lines(capsys) == [
        "%lab kill RANK: SIGKILL a rank's process, also during a run (lab.kill); %lab heal replaces it",
        "  RANK  the rank to kill",
    ]
    shell.run_cell_magic("lab", "--help", "print(rank)")  # help only: the cell does not run
    assert printed_lines(capsys) == [
        "%%lab [options]: run the cell on every rank (or some); what they print and display labelled [rank r] "
        "(alike: once), the last value shown",
        "  --ranks 0,2       run on these ranks only",
        "  --site NAME       on the ranks of this site (a machine that joined over HTTPS)",
        "  --timeout S       limit for this cell, seconds",
        "  --instruments     watch the cell's loop: its report is the value",
        "  --dashboard       draw the cell's loop live (instruments on)",
        "  --background      return at once; .stop() ends it at a step",
        "  --view tabs|grid  each rank's output on a page of its own: tabs, or a grid of columns",
    ]
    for line in ("train --help", "train --model gpt -h", "start -h", "start 2 --backend mpi --help", "bench --help",
                 "link --help", "run --ranks 0 --help", "tasks -h", "ensemble --help", "status --help",
                 "mesh -h", "slow --help", "seed -h", "checkpoint --help", "timeout -h", "join-command --help",
                 "join-command --https --help", "sites --help", "push --help", "who --help", "who --ranks 1 -h",
                 "debug --help"):
        command = line.split()[0]
        shell.run_line_magic("lab", line)
        lines = printed_lines(capsys)
        assert lines[0].startswith(f"%lab {command}"), (line, lines)
        # one line an option: no line wrapped onto an indented next one
        assert all(text.startswith("  ") and not text.startswith("   ") for text in lines[1:]), (line, lines)
        assert not any("usage:" in text or "error" in text for text in lines), (line, lines)
    shell.run_line_magic("lab", "train --help")
    options = [text.split()[0] for text in printed_lines(capsys)[1:]]
    for option in ("--strategy", "--model", "--steps", "--dashboard", "--bucket-cap-mb", "--no-reshard",
                   "--schedule", "--inner-steps"):
        assert options.count(option) == 1, (option, options)


def test_help_of_lab_lists_every_command_on_its_own_line(shell, capsys):
    shell.run_line_magic("lab", "--help")
    lines = printed_lines(capsys)
    assert lines[0] == "%lab COMMAND [options]: live torch.distributed ranks; %lab COMMAND --help for its options"
    commands = [text.split()[0] for text in lines[1:-1]]
    assert commands == ["start", "mesh", "train", "slow", "link", "seed", "push", "run", "bench", "checkpoint", "kill",
                        "heal", "debug", "tasks", "ensemble", "join-command", "sites", "status", "who", "auto",
                        "timeout", "restart", "stop"]
    assert lines[-1].startswith("%%lab [options]: run the cell on every rank")
    shell.run_line_magic("lab", "-h")
    assert printed_lines(capsys) == lines
    # A script's own --help is the script's, not %lab run's (no lab: refused for that, not shown help).
    with pytest.raises(UsageError, match="no lab is running"):
        shell.run_line_magic("lab", "run train.py --help")


def test_a_mistyped_command_or_option_says_what_was_meant_in_one_line(shell):
    with pytest.raises(UsageError) as refused:
        shell.run_line_magic("lab", "trian --steps 5")
    assert str(refused.value) == (
        "unknown command 'trian': did you mean 'train'? The commands: start, mesh, train, slow, link, seed, push, "
        "run, bench, checkpoint, kill, heal, debug, tasks, ensemble, join-command, sites, status, who, auto, timeout, "
        "restart, stop (see %lab --help)")
    # The words are checked before the lab is looked for: no lab is running here.
    for line, said in [
        ("train --model resnet", "--model: the notebook has no 'resnet'; give the zoo's mlp or gpt, or a name the "
                                 "notebook defines (see %lab train --help)"),
        ("train --model gtp", "--model: the notebook has no 'gtp'; did you mean 'gpt'? give the zoo's mlp or gpt, "
                              "or a name the notebook defines (see %lab train --help)"),
        ("train --stpes 5", "unknown option --stpes: did you mean --steps? (see %lab train --help)"),
        ("train --schedule 1f2b", "--schedule: unknown schedule '1f2b': did you mean '1f1b'? choose gpipe or 1f1b "
                                  "(see %lab train --help)"),
        ("start 2 --thread 1", "unknown option --thread: did you mean --threads? (see %lab start --help)"),
        ("bench allreduse", "unknown operation 'allreduse': did you mean 'allreduce'? choose allreduce, "
                            "all_reduce, allgather, all_gather, reduce_scatter, reducescatter or broadcast "
                            "(see %lab bench --help)"),
        ("ensemble --vary colour", "--vary: unknown vary 'colour'; choose seed or lr (see %lab ensemble --help)"),
    ]:
        with pytest.raises(UsageError) as refused:
            shell.run_line_magic("lab", line)
        assert str(refused.value) == said



@pytest.mark.parametrize("line, error, message", BAD_STARTS)
def test_bad_start_arguments_are_refused_before_starting(shell, line, error, message):
    with pytest.raises(error, match=message):
        shell.run_line_magic("lab", line)


def test_start_publishes_the_lab(started, capsys):
    lab = started.user_ns["lab"]
    assert isinstance(lab, Lab) and lab.running and lab.world_size == 2
    started.run_line_magic("lab", "start 2 --backend gloo --threads 1")
    assert "reusing it" in capsys.readouterr().out
    assert started.user_ns["lab"] is lab


def test_mesh_magic_draws_and_validates(started):
    spec = started.run_line_magic("lab", "mesh dp=1 tp=-1")
    assert spec.shape == (1, 2) and "groups along tp: [0, 1]" in str(spec)
    with pytest.raises(MeshError, match="must multiply to 2"):
        started.run_line_magic("lab", "mesh dp=4")


def test_cell_magic_runs_on_every_rank(started, capsys):
    started.run_cell_magic("lab", "", "value = rank + 1\nprint('value', value)")
    started.run_cell_magic("lab", "--ranks 1", "value * 10")
    out = capsys.readouterr().out
    assert "[rank 0] value 1" in out and "[rank 1] value 2" in out
    assert "[rank 1] Out: 20" in out and "[rank 0] Out" not in out


def test_auto_mode_runs_plain_cells_on_every_rank_until_turned_off(started, capsys):
    started.run_line_magic("lab", "auto")
    try:
        started.run_cell("auto_value = rank * 10\nprint('auto', auto_value)")
        started.run_cell("%lab status")  # a magic's cell runs in the notebook, auto or not
    finally:
        started.run_line_magic("lab", "auto off")
    out = capsys.readouterr().out
    assert out.startswith("every cell now runs on the ranks") and "%lab auto: on ranks 0-1\n" in out, out
    assert "[rank 0] auto 0\n" in out and "[rank 1] auto 10\n" in out, out  # (outside a kernel: as they come)
    assert "auto_value" not in started.user_ns  # it ran on the ranks, not here
    assert started.user_ns["lab"].run_cell("auto_value") == ["0", "10"]
    started.run_cell("here_value = 1")
    assert started.user_ns["here_value"] == 1
    with pytest.raises(UsageError, match="write %lab auto"):
        started.run_line_magic("lab", "auto sometimes")


def test_cell_magic_failure_and_per_cell_timeout(started):
    with pytest.raises(RankFailure, match="rank 0 raised ZeroDivisionError"):
        started.run_cell_magic("lab", "", "x = torch.ones(1)\nif rank == 0:\n    1 / 0\ndist.all_reduce(x)")
    with pytest.raises(RankFailure, match="did not finish within 1 s"):
        started.run_cell_magic("lab", "--timeout 1", "import time\ntime.sleep(60)")
    started.run_cell_magic("lab", "", "dist.barrier()")


def test_timeout_and_status_commands(started, capsys):
    started.run_line_magic("lab", "timeout 45")
    assert started.user_ns["lab"].timeout == 45
    with pytest.raises(UsageError, match="positive"):
        started.run_line_magic("lab", "timeout -3")
    status = started.run_line_magic("lab", "status")
    assert status.healthy and "cell timeout 45 s" in str(status)
    with pytest.raises(UsageError, match="--ranks"):
        started.run_cell_magic("lab", "--ranks one", "rank")
    with pytest.raises(UsageError) as refused:
        started.run_cell_magic("lab", "--rank 0", "rank")
    assert str(refused.value) == "unknown option --rank: did you mean --ranks? (see %%lab --help)"


def test_train_magic_runs_a_strategy_and_verifies(started, capsys):
    report = started.run_line_magic(
        "lab", "train --strategy fsdp --model gpt --steps 2 --batch 8 --verify --model-settings dim=16,heads=2,seq=8"
    )
    assert report.equivalent and report.config.strategy == "fsdp"
    assert "step    2/2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="2 ranks cannot be split over 2 axes"):
        started.run_line_magic("lab", "train --strategy ddp+pp --model gpt")
    with pytest.raises(UsageError, match="name=value"):
        started.run_line_magic("lab", "train --model-settings dim")


def test_slow_bench_and_dashboard_magics(started, capsys):
    started.run_line_magic("lab", "slow 1 20ms")
    assert "rank 1 now takes 20 ms longer" in capsys.readouterr().out
    started.run_line_magic("lab", "slow 1 off")
    assert "rank 1 runs at its own speed again" in capsys.readouterr().out
    with pytest.raises(UsageError, match="30ms"):
        started.run_line_magic("lab", "slow 1 soon")
    with pytest.raises(UsageError, match="e.g. %lab slow 2 30ms"):
        started.run_line_magic("lab", "slow 1")
    bench = started.run_line_magic("lab", "bench allreduce --sizes 1KB:4KB --iters 3")
    assert bench.sizes == [1024, 2048, 4096] and "all_reduce on 2 ranks" in str(bench)
    run = started.run_line_magic("lab", "train --model mlp --steps 3 --batch 8 --dashboard")
    report = run.wait(120)
    assert report.steps_done == 3
    # The last draw shows the finished run: every step's loss in the picture (the header's final
    # status is checked in tests/unit/runs/test_training_run.py).
    assert list(run.dashboard.picture.loss_line.get_xdata()) == [0, 1, 2]
    assert list(run.dashboard.picture.loss_line.get_ydata()) == pytest.approx(report.losses)
    assert run.dashboard.image.value[:3] == b"\xff\xd8\xff"  # a JPEG frame


def test_join_command_of_a_loopback_lab_says_only_this_machine_can_join(started, capsys):
    started.run_line_magic("lab", "join-command")
    printed = capsys.readouterr().out
    assert printed.startswith("python -m labkit join ")
    assert "share it like a password" in printed
    assert "only processes on this machine can join" in printed and "--controller-address" in printed


def test_absurd_values_are_refused_before_the_ranks_work(started, capsys):
    # A terabyte message was allocated on every rank (torch's allocator failed on each, 30 lines of traceback):
    # now the ranks' free memory is asked first and the request refused in one line, the ranks left as they were.
    with pytest.raises(LabConfigError, match=r"a message of 2 TiB does not fit: each rank has about .* free, .* "
                                             r"the largest message is .*; e.g. sizes='1KB:16MB'"):
        started.run_line_magic("lab", "bench allreduce --sizes 1TB:2TB")
    lab = started.user_ns["lab"]
    with pytest.raises(LabConfigError, match="a message of 1 TiB does not fit"):
        lab.bench_collective("all_reduce", sizes=[2**40])
    # A delay of 1e9 s made the next run hang to its limit; now refused below the lab's time limit (whatever
    # an earlier test of this module left it at).
    with pytest.raises(LabConfigError, match=rf"not including, the lab's time limit \({lab.timeout:g} s"):
        started.run_line_magic("lab", "slow 0 1e9s")
    with pytest.raises(LabConfigError, match="lr is a learning rate above 0 and at most 10"):
        started.run_line_magic("lab", "train --lr 1e308 --steps 2")
    with pytest.raises(LabConfigError, match="model 'gpt': setting dim is a whole number, got 'abc'"):
        started.run_line_magic("lab", "train --model gpt --model-settings dim=abc --steps 2")
    capsys.readouterr()
    assert lab.run(lambda: 3) == [3, 3] and lab.session.control.slow == {}  # nothing was slowed or broken
