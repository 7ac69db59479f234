"""The user's own model, data and loss in ``lab.train``, on one real 4-rank lab started through IPython's shell.

Everything the model is made of is written in the shell's cells (``define``), as a notebook
would: a CNN class on scikit-learn's digits (real data shipped inside its wheel), a small
transformer-like class with blocks, a Hugging Face Llama built from a config with no weights.
Each trains under the lab's strategies, with the single-process proof (``verify``), resumes
bitwise, saves and loads checkpoints, and is refused, before any rank works, where a strategy
needs what was not given.
"""

import os
import time

import pytest
import torch

from labkit.spec.errors import LabConfigError
from labkit.wire.entry import this_rank
from tests.conftest import lab_shell

pytestmark = pytest.mark.lab

DIGITS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
labels = torch.tensor(digits.target, dtype=torch.long)
train_set = TensorDataset(images[:1500], labels[:1500])
held_out = (images[1500:], labels[1500:])

WIDTH = 8

class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, WIDTH, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH * 16, 64), nn.Linear(64, 64)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
        for block in self.blocks:
            x = F.relu(block(x))
        return self.head(x)

def accuracy(state):
    net = DigitsCNN()
    net.load_state_dict(state)
    with torch.no_grad():
        return (net(held_out[0]).argmax(1) == held_out[1]).float().mean().item()
'''

BLOCKS = '''
class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))

class Tower(nn.Module):
    def __init__(self, dim=16, depth=4):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)
        # Not in the state dict: a split built on the meta device must still be given it.
        self.register_buffer("gain", torch.linspace(0.5, 1.5, dim), persistent=False)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain)

def regression(step, generator):
    x = torch.randn(16, 8, generator=generator)
    return x, torch.stack([x[:, :3].sum(1), x[:, 3:6].prod(1), x[:, 6:].sin().sum(1)], dim=1)

def mse(output, batch):
    return F.mse_loss(output, batch[1])
'''


@pytest.fixture(scope="module")
def shell():
    with lab_shell("4 --backend gloo --threads 1 --timeout 120") as ip:
        define(ip, DIGITS + BLOCKS)
        yield ip


@pytest.fixture(scope="module")
def lab(shell):
    return shell.user_ns["lab"]


def define(shell, code: str) -> dict:
    shell.run_cell(code).raise_error()
    return shell.user_ns


def verified(report) -> None:
    assert report.max_relative_difference < report.equivalence_bound, str(report)
    assert report.verify["model_moved"] > 1e-3, "training must move the model, or equality proves nothing"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_notebook_cnn_learns_the_digits_equal_to_one_process(shell, lab, strategy, capsys):
    notebook = shell.user_ns
    report = lab.train(strategy, model=notebook["DigitsCNN"], data=notebook["train_set"], steps=20,
                       global_batch=64, lr=1e-2, verify=True, log_every=100)
    verified(report)
    assert report.losses[-1] < report.losses[0] * 0.6
    said = capsys.readouterr().out
    assert ("cross-entropy" in said) == (strategy == "ddp")  # the default loss is said once, at the first run
    assert "DigitsCNN under " + strategy in str(report)
    accuracy = notebook["accuracy"](lab.model_state())
    assert accuracy > 0.5, f"held-out accuracy {accuracy:.2f} after 20 steps"


def test_fsdp_shards_the_largest_module_list_by_default_and_given_classes(shell, lab):
    notebook = shell.user_ns
    ddp = lab.train("ddp", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"], steps=1)
    fsdp = lab.train("fsdp", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"], steps=2,
                     verify=True)
    verified(fsdp)
    assert max(m["params"] for m in fsdp.memory) < max(m["params"] for m in ddp.memory) / 2
    units = lab.train("fsdp", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"], steps=2,
                      fsdp_units=[notebook["Block"]], verify=True)
    verified(units)


def test_a_notebook_class_under_pp_with_split_points(shell, lab):
    notebook = shell.user_ns
    report = lab.train("pp", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"], steps=3,
                       pp_split=["blocks.1", "blocks.2", "blocks.3"], verify=True)
    verified(report)
    report = lab.train("ddp+pp", mesh=dict(dp=2, pp=2), model=notebook["Tower"], data=notebook["regression"],
                       loss=notebook["mse"], steps=3, pp_split=["blocks.2"], global_batch=16, verify=True)
    verified(report)


def test_tp_takes_a_plan_of_module_patterns(shell, lab):
    notebook = shell.user_ns
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    report = lab.train("tp", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"], steps=3,
                       tp_plan=plan, verify=True)
    verified(report)
    report = lab.train("fsdp+tp", mesh=dict(dp=2, tp=2), model=notebook["Tower"], data=notebook["regression"],
                       loss=notebook["mse"], steps=3, tp_plan=plan, verify=True)
    verified(report)


def test_diloco_and_the_parameter_server_need_no_more_input(shell, lab):
    notebook = shell.user_ns
    report = lab.train("diloco", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"],
                       steps=4, verify=True)
    verified(report)
    report = lab.train("ps", model=notebook["DigitsCNN"], data=notebook["train_set"], steps=4, verify=True)
    verified(report)
    with pytest.raises(LabConfigError, match="Your data function makes each step's batch: make it return 15 or 18 rows"):
        lab.train("ps", model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"])


def test_what_a_strategy_lacks_is_refused_before_any_rank_works(shell, lab):
    notebook = shell.user_ns
    own = dict(model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"])
    with pytest.raises(LabConfigError, match=r"tp needs a plan.*tp_plan=\{"):
        lab.train("tp", **own)
    with pytest.raises(LabConfigError, match=r"pp needs split points.*pp_split=\["):
        lab.train("pp", **own)
    with pytest.raises(LabConfigError, match=r"blocks\.9"):
        lab.train("pp", pp_split=["blocks.1", "blocks.2", "blocks.9"], **own)
    with pytest.raises(LabConfigError, match=r"blocks\.\*\.nothing"):
        lab.train("tp", tp_plan={"blocks.*.nothing": "colwise"}, **own)
    with pytest.raises(LabConfigError, match="returns 16 rows"):
        lab.train("ddp", global_batch=32, **own)
    with pytest.raises(LabConfigError, match=r"data describe your own model; mlp is a model of the zoo"):
        lab.train("ddp", model="mlp", data=notebook["train_set"])
    define(shell, "class Dropping(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                  "        self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 3))\n\n"
                  "    def forward(self, x):\n        return self.body(x)\n")
    with pytest.raises(LabConfigError, match=r"body\.1.*p=0\.2"):
        lab.train("ddp", model=notebook["Dropping"], data=notebook["regression"], loss=notebook["mse"], verify=True)
    assert lab.session.busy_with is None


def test_resume_continues_from_the_data_position_bitwise(shell, lab):
    notebook = shell.user_ns
    own = dict(model=notebook["DigitsCNN"], data=notebook["train_set"], global_batch=64, log_every=100)
    lab.train("fsdp", steps=30, **own)  # 30 x 64 samples: past the first epoch of 1,500
    whole = lab.model_state()
    lab.train("fsdp", steps=18, **own)
    lab.train(steps=12, resume=True)
    resumed = lab.model_state()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


def test_a_checkpoint_in_a_users_folder_loads_resharded_and_asks_for_the_model(shell, lab, tmp_path):
    notebook = shell.user_ns
    own = dict(model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"])
    folder = tmp_path / "my experiments"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    lab.train("fsdp", steps=3, **own)
    target = lab.save(str(folder / "tower"))
    lab.train("fsdp", steps=2, resume=True)
    after_five = lab.model_state()
    with pytest.raises(LabConfigError, match=r"your own model Tower: give it again"):
        lab.load(target)
    lab.load(target, strategy="ddp", **own)
    lab.train(steps=2, resume=True)
    reloaded = lab.model_state()
    assert all(torch.allclose(after_five[name], reloaded[name], rtol=1e-5, atol=1e-6) for name in after_five)
    assert (folder / "notes.txt").read_text() == "mine"
    assert os.path.isdir(target)


def test_the_magic_takes_the_notebooks_names(shell, lab, capsys):
    report = shell.run_line_magic("lab", "train --strategy ddp --model Tower --data regression --loss mse --steps 2")
    assert report.steps_done == 2
    assert "Tower under ddp" in str(report)


def test_a_hugging_face_llama_with_its_own_tp_plan(shell, lab, capsys):
    pytest.importorskip("transformers")
    define(shell, '''
import glob, os, sysconfig
from transformers import LlamaConfig, LlamaForCausalLM

text = "".join(open(path, encoding="utf-8").read() for path in sorted(glob.glob(
    os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))))
alphabet = sorted(set(text))
ids = torch.tensor([alphabet.index(c) for c in text[:20000]])
llama_config = LlamaConfig(vocab_size=len(alphabet), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)

def tiny_llama():
    return LlamaForCausalLM(llama_config)

def characters(step, generator):
    starts = torch.randint(0, len(ids) - 33, (8,), generator=generator)
    window = torch.stack([ids[s:s + 33] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]
''')
    notebook = shell.user_ns
    own = dict(model=notebook["tiny_llama"], data=notebook["characters"], steps=3, verify=True, log_every=100)
    for strategy, mesh in (("fsdp", None), ("tp", None), ("fsdp+tp", dict(dp=2, tp=2))):
        report = lab.train(strategy, mesh=mesh, **own)
        verified(report)
        assert report.tokens_per_second is not None
    define(shell, "def logits_loss(output, batch):\n"
                  "    return F.cross_entropy(output.logits.flatten(0, 1), batch[1].flatten())\n")
    assert notebook["llama_config"].use_cache  # the default: the lab cuts the stages without the cache
    report = lab.train("ddp+pp", mesh=dict(dp=2, pp=2), model=notebook["tiny_llama"], data=notebook["characters"],
                       loss=notebook["logits_loss"], pp_split=["model.layers.1"], steps=3, verify=True)
    verified(report)  # the last stage's logits rebuilt into the model's own output for a loss that reads it
    assert "LlamaForCausalLM is cut into pipeline stages with use_cache=False" in capsys.readouterr().out
    define(shell, "llama_config.num_key_value_heads = 2")
    with pytest.raises(LabConfigError, match="num_key_value_heads=2"):
        lab.train("tp", **own)


def test_auto_heal_sends_the_model_again_and_ends_as_an_uninterrupted_run(shell, lab, tmp_path):
    notebook = shell.user_ns
    own = dict(model=notebook["DigitsCNN"], data=notebook["train_set"], global_batch=64, log_every=1000)
    lab.train("fsdp", steps=16, **own)
    uninterrupted = lab.model_state()
    lab.slow(2, 0.05)  # the kill lands mid-run
    try:
        run = lab.train("fsdp", steps=16, checkpoint_every=4, checkpoint_dir=str(tmp_path), auto_heal=True,
                        background=True, **own)
        deadline = time.monotonic() + 60
        while not (tmp_path / "step-00000004" / "labkit.json").exists() and time.monotonic() < deadline:
            assert not run.done, run.status()
            time.sleep(0.05)
        lab.kill(1)  # its replacement has an empty namespace: DigitsCNN, nn, F... must come with the run
        report = run.wait(120)
    finally:
        lab.slow(2, None)
    assert len(report.notes) == 1 and "rank 1 died" in report.notes[0]
    healed = lab.model_state()
    assert all(torch.equal(uninterrupted[name], healed[name]) for name in uninterrupted)


def test_the_dashboard_and_the_memory_budget_work_for_an_own_model(shell, lab):
    from labkit.runs.budget import MemoryBudgetError

    notebook = shell.user_ns
    own = dict(model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"])
    run = lab.train("ddp", steps=6, dashboard=True, background=True, **own)
    report = run.wait(60)
    assert report.steps_done == 6 and run.dashboard is not None
    assert all(len(run.table.rows[rank]) == 6 for rank in range(4))  # every rank's step rows reached it
    with pytest.raises(MemoryBudgetError, match=r"(?s)Tower under ddp needs .*under sharding strategies on these 4 ranks: fsdp"):
        lab.train("ddp", max_memory="8KB", **own)


WIDE = '''
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(2048, 2048), nn.Linear(2048, 2048)

    def forward(self, x):
        return torch.tanh(self.down(torch.tanh(self.up(x))))

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Pair() for _ in range(12)])  # 403 MB of float32
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 2048), persistent=False)  # no state dict carries it

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.gain

def wide_data(step, generator):
    x = torch.randn(8, 2048, generator=generator)
    return x, x.flip(1)

def peak_mb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
'''


def test_a_sharded_model_is_never_whole_on_a_rank_but_rank_0(shell, lab):
    """tp and fsdp build the network on the meta device and split it there; only rank 0 builds it whole (on its
    CPU) and sends each rank its pieces, so a model too big for every rank at once still trains."""
    notebook = define(shell, WIDE)
    whole_mb = 24 * (2048 * 2048 + 2048) * 4 / 2**20
    own = dict(model=notebook["Wide"], data=notebook["wide_data"], loss=notebook["mse"], optimizer="sgd", lr=1e-3)
    for strategy, plan in (("tp", {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}), ("fsdp", None)):
        before = lab.run(notebook["peak_mb"])
        report = lab.train(strategy, steps=2, tp_plan=plan, **own)
        grown = [after - first for after, first in zip(lab.run(notebook["peak_mb"]), before)]
        assert report.steps_done == 2 and all(loss == loss for loss in report.losses)  # no NaN from an empty tensor
        if strategy == "tp":  # (FSDP's gathers on the CPU leave glibc's heap fragmented: its peak says nothing)
            # Built whole everywhere, every rank grew by 470 MB here; split on meta, ranks 1-3 grow by ~290 MB
            # (a quarter of the weights, their gradients, one packet in flight, the allocator's slack).
            assert max(grown[1:]) < min(whole_mb, grown[0] - 0.5 * whole_mb), (grown, whole_mb)
        gains = lab.run(lambda: this_rank().train_state.model.gain.tolist())  # sent by rank 0, not left empty
        assert all(gain == torch.linspace(0.5, 1.5, 2048).tolist() for gain in gains)


SHAPES = '''
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(3, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, a, b):
        h = torch.tanh(self.a(a) + self.b(b))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)

def pairs(step, generator):
    a, b = torch.randn(16, 4, generator=generator), torch.randn(16, 3, generator=generator)
    return (a, b), (a.sum(1) > b.sum(1)).long()

class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2)])
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

def token_windows(step, generator):
    ids = torch.randint(0, 20, (16, 9), generator=generator)
    return ids[:, :-1], ids[:, 1:]

class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(6, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])

def sequences(step, generator):
    x = torch.randn(16, 5, 6, generator=generator)
    return x, (x.sum((1, 2)) > 0).long() + (x[:, 0, 0] > 0).long()
'''


def test_models_of_other_shapes_two_inputs_tied_weights_a_recurrent_layer(shell, lab):
    """((a, b), y) batches call model(a, b), through a pipeline too; weights tied between the embedding and
    the output layer stay one parameter when a split model is built on meta; a GRU shards under FSDP."""
    notebook = define(shell, SHAPES)
    verified(lab.train("fsdp", model=notebook["TwoInputs"], data=notebook["pairs"], steps=3, lr=1e-2, verify=True))
    verified(lab.train("ddp+pp", mesh=dict(dp=2, pp=2), model=notebook["TwoInputs"], data=notebook["pairs"],
                       steps=3, lr=1e-2, pp_split=["blocks.1"], verify=True))
    plan = {"blocks.*.0": "colwise", "blocks.*.2": "rowwise"}
    verified(lab.train("tp", model=notebook["TiedLM"], data=notebook["token_windows"], steps=3, lr=1e-2,
                       tp_plan=plan, verify=True))
    model = lambda: this_rank().train_state.model  # noqa: E731 - on each rank
    assert all(lab.run(lambda: model().head.weight is model().embed.weight))
    verified(lab.train("fsdp", model=notebook["Recurrent"], data=notebook["sequences"], steps=3, lr=1e-2,
                       verify=True))


def test_a_loss_that_raises_on_a_pipelines_last_stage_lets_the_other_stages_go(shell, lab):
    """The other stages wait in receives for what the failed stage will never send: the lab names the failure
    and releases them at once instead of at the cell's limit, and the next run trains."""
    from labkit.spec.errors import RankFailure

    notebook = define(shell, "def broken_loss(output, batch):\n    raise ValueError('my loss is broken')\n")
    own = dict(model=notebook["Tower"], data=notebook["regression"], pp_split=["blocks.1", "blocks.2", "blocks.3"])
    with pytest.raises(RankFailure, match=r"rank 3 raised ValueError: my loss is broken; ranks 0, 1, 2 failed in a "
                                          r"collective as a consequence of rank 3"):
        lab.train("pp", steps=2, loss=notebook["broken_loss"], **own)
    verified(lab.train("pp", steps=2, loss=notebook["mse"], verify=True, **own))


def test_a_checkpoint_loads_on_another_number_of_ranks(shell, lab, tmp_path):
    from tests.conftest import started_lab

    notebook = shell.user_ns
    own = dict(model=notebook["Tower"], data=notebook["regression"], loss=notebook["mse"])
    lab.train("fsdp", steps=3, **own)
    target = lab.save(str(tmp_path / "tower"))
    lab.train(steps=2, resume=True)
    after_five = lab.model_state()
    with started_lab(2) as two:
        two.load(target, **own)
        two.train(steps=2, resume=True)
        on_two = two.model_state()
    assert all(torch.allclose(after_five[name], on_two[name], rtol=1e-5, atol=1e-6) for name in after_five)


GATED = '''
class Gated(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.gate = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))

class GatedTower(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([Gated(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def regression_on_the_ranks():
    return regression

class RaisingInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, x):
        scale = 2.0
        raise ValueError("forward refuses")
'''


def test_a_gated_block_trains_under_the_plan_its_refusal_suggests(shell, lab, capsys):
    import json

    notebook = define(shell, GATED)
    own = dict(model=notebook["GatedTower"], data=notebook["regression"], loss=notebook["mse"], steps=2)
    with pytest.raises(LabConfigError, match=r"tp needs a plan") as refused:
        lab.train("tp", **own)
    suggested = json.loads(str(refused.value).split("tp_plan=", 1)[1])
    assert suggested == {"blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    verified(lab.train("tp", tp_plan=suggested, verify=True, **own))
    started = time.perf_counter()
    with pytest.raises(LabConfigError, match="tp_plan does not fit together"):  # gate reads x, not up's output
        lab.train("tp", tp_plan={"blocks.*.up": "colwise", "blocks.*.gate": "rowwise"}, **own)
    assert time.perf_counter() - started < 2, "refused in the notebook, before any rank works"
    # Data made on the ranks leaves nothing to try the plan on in the notebook: the ranks fail, and torch's
    # logged tracebacks are folded into the one error instead of printed beside it.
    capsys.readouterr()
    with pytest.raises(Exception) as failed:
        lab.train("tp", model=notebook["GatedTower"], data=notebook["regression_on_the_ranks"],
                  loss=notebook["mse"], steps=1, global_batch=16,
                  tp_plan={"blocks.*.up": "colwise", "blocks.*.gate": "rowwise"})
    said = capsys.readouterr()
    assert "failed while attempting to run meta" not in said.out + said.err
    shown = "\n".join([str(failed.value), *getattr(failed.value, "__notes__", [])])
    assert "torch logged" in shown and "reduction dim" in shown


def test_an_error_in_forward_shows_the_cells_line_and_not_the_labs_frames(shell, lab):
    notebook = define(shell, GATED)
    with pytest.raises(Exception) as failed:
        lab.train("ddp", model=notebook["RaisingInForward"], data=notebook["regression"], loss=notebook["mse"],
                  steps=1)
    shown = "\n".join([str(failed.value), *getattr(failed.value, "__notes__", [])])
    assert 'raise ValueError("forward refuses")' in shown  # the line of the cell the class was written in
    assert "lab frames hidden)" in shown
    assert "labkit/rank/loop.py" not in shown and "labkit/strategies" not in shown
