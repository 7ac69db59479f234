"""Packing the user's own model in the notebook: what travels, what is counted, what is refused (no processes).

The notebook's code is made as IPython makes it: compiled under a cell's name, its lines kept
in ``linecache``, run in ``__main__``'s namespace.
"""

import json
import linecache
import sys

import pytest
import torch

from labkit.runs.own_model import pack_own, split_settings
from labkit.runs.own_run_checks import check_run, say_once
from labkit.spec.errors import LabConfigError
from labkit.spec.train_config import checkpoint_settings, identity_differences, resolve, resume_differences

CELL = '''
import torch.nn as nn
import torch.nn.functional as F

HIDDEN = 10

def activation(x):
    return F.gelu(x)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return activation(self.inner(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))

class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.gate = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))

class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Gated() for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def make_batch(step, generator):
    x = torch.randn(8, 4, generator=generator)
    return x, (x.sum(1) > 0).long()

def tokens(step, generator):
    ids = torch.randint(0, 10, (4, 16), generator=generator)
    return ids, ids

def summed(output, batch):
    return output.sum()

unrelated = object()
'''


@pytest.fixture()
def notebook(monkeypatch):
    """The cell above, defined in ``__main__`` as a notebook defines it; removed afterwards."""
    main = sys.modules["__main__"]
    name = "<ipython-input-own-model>"
    lines = CELL.splitlines(keepends=True)
    linecache.cache[name] = (len(CELL), None, lines, name)
    namespace: dict = {"__name__": "__main__", "torch": torch}
    exec(compile(CELL, name, "exec"), namespace)
    for key, value in namespace.items():
        if not key.startswith("__"):
            monkeypatch.setattr(main, key, value, raising=False)
    # The notebook's names are IPython's user namespace when a shell runs (another test may have started one).
    monkeypatch.setattr("labkit.runs.own_model._notebook_namespace", lambda: vars(main))
    yield namespace
    linecache.cache.pop(name, None)


def test_the_names_the_model_reads_travel_with_it_and_nothing_else(notebook):
    own, inspection = pack_own(notebook["Net"], data=notebook["make_batch"])
    travelled = dict(own.travelled)
    assert {"nn", "F", "HIDDEN", "activation", "Block", "Net"} <= set(travelled)
    assert travelled["Block"] == "by source" and travelled["nn"] == "module torch.nn"
    assert "unrelated" not in travelled
    assert own.name == "Net"
    assert own.parameters == sum(p.numel() for p in notebook["Net"]().parameters())
    assert inspection.rows == 8
    assert next(inspection.network.parameters()).device.type == "meta"


def test_the_same_model_packed_twice_is_equal_and_a_changed_one_is_not(notebook):
    first, _ = pack_own(notebook["Net"], data=notebook["make_batch"])
    again, _ = pack_own(notebook["Net"], data=notebook["make_batch"])
    assert first == again and first.shapes == again.shapes
    other, _ = pack_own(notebook["Net"], data=notebook["make_batch"], loss=notebook["summed"])
    assert other != first and other.shapes == first.shapes


def test_a_data_functions_rows_become_the_global_batch_and_a_zoo_model_refuses_own_settings(notebook):
    settings, inspection = split_settings(dict(model=notebook["Net"], data=notebook["make_batch"]))
    assert settings["global_batch"] == 8 and settings["model"] == "Net" and inspection is not None
    with pytest.raises(LabConfigError, match="data describe your own model; gpt is a model of the zoo"):
        split_settings(dict(model="gpt", data=notebook["make_batch"]))
    with pytest.raises(LabConfigError, match="needs its data"):
        split_settings(dict(model=notebook["Net"]))
    with pytest.raises(LabConfigError, match="not a torch.nn.Module"):
        split_settings(dict(model=lambda: 3, data=notebook["make_batch"]))


def _config(notebook, strategy="ddp", **settings):
    settings, inspection = split_settings(dict(model=notebook["Net"], data=notebook["make_batch"], **settings))
    return resolve(4, strategy=strategy, **settings), inspection


def test_refusals_name_what_to_pass(notebook):
    config, inspection = _config(notebook, "tp")
    with pytest.raises(LabConfigError, match=r"tp needs a plan.*tp_plan="):
        check_run(inspection, config)
    config, inspection = _config(notebook, "pp", global_batch=16)
    with pytest.raises(LabConfigError, match=r"pp_split=\["):
        check_run(inspection, config)
    config, inspection = _config(notebook, "ddp", verify=True)
    with pytest.raises(LabConfigError, match=r"drop.*p=0\.1"):
        check_run(inspection, config)
    config, inspection = _config(notebook, "tp", tp_plan={"blocks.*.inner": "colwise"})
    with pytest.raises(LabConfigError, match=r"blocks\.0\.inner"):
        check_run(inspection, config)  # 10 output features do not split over 4 ranks
    config, inspection = _config(notebook, "ddp", global_batch=16)
    with pytest.raises(LabConfigError, match="returns 8 rows per step"):
        check_run(inspection, config)


def test_an_option_no_part_of_the_strategy_reads_is_refused_naming_its_strategy(notebook):
    for option, value, owner in (("tp_plan", {"blocks.*.inner": "colwise"}, "tp"), ("pp_split", ["blocks.1"], "pp"),
                                 ("fsdp_units", ["Block"], "fsdp")):
        config, inspection = _config(notebook, "ddp", **{option: value})
        with pytest.raises(LabConfigError, match=rf"^{option} is a setting of {owner} \(.*\): add {owner} to the "
                                                 rf"strategy, or drop {option}$"):
            check_run(inspection, config)
    config, inspection = _config(notebook, "fsdp", fsdp_units=["Block"])
    check_run(inspection, config)  # read by the strategy: accepted


def test_a_model_that_returns_its_cache_is_said_once_to_be_cut_without_it(notebook, capsys):
    class Settings:
        use_cache = True

    config, inspection = _config(notebook, "pp", pp_split=["blocks.1", "blocks.2", "head"], global_batch=8)
    assert check_run(inspection, config) == []  # no Hugging Face config: nothing changed, nothing said
    inspection.network.config = Settings()
    notes = check_run(inspection, config)
    assert notes == ["labkit: Net is cut into pipeline stages with use_cache=False (its key/value cache is no tensor "
                     "a pipeline passes); its config is left as it is"]
    said: set[str] = set()
    say_once(said, notes)
    say_once(said, notes)
    assert capsys.readouterr().out == notes[0] + "\n"


def test_a_tp_plan_is_tried_on_the_meta_device_and_a_refusal_suggests_one_that_ran(notebook):
    def gated(**settings):
        settings, inspection = split_settings(dict(model=notebook["GatedNet"], data=notebook["make_batch"],
                                                   **settings))
        return inspection, resolve(4, strategy="tp", **settings)

    suggestion = '{"blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}'
    with pytest.raises(LabConfigError) as refused:
        check_run(*gated())
    assert str(refused.value) == f"tp needs a plan for this model: pass tp_plan={suggestion}"
    with pytest.raises(LabConfigError) as refused:
        check_run(*gated(tp_plan={"blocks.*.up": "colwise", "blocks.*.gate": "rowwise"}))  # gate reads x, not up's
    assert str(refused.value).startswith("tp_plan does not fit together: one rank's slice of GatedNet fails on the "
                                         "meta device with RuntimeError: ")
    assert str(refused.value).endswith(f"e.g. tp_plan={suggestion}")
    assert check_run(*gated(tp_plan=json.loads(suggestion))) == []


def test_a_checkpoint_records_the_models_identity_and_a_load_compares_it(notebook):
    config, _ = _config(notebook)
    saved = checkpoint_settings(config)["settings"]
    assert saved["own"] == {"name": "Net", "shapes": config.own.shapes}
    assert identity_differences(saved, {"own": config.own}) == []
    assert identity_differences(saved, {"own": None})  # given nothing for a checkpoint of an own model
    assert resume_differences(config, config) == []


def test_an_ensemble_of_an_own_model_is_refused_naming_lab_train(notebook):
    from labkit.runs.ensemble import run_ensemble

    with pytest.raises(LabConfigError, match=r"lab.ensemble trains the catalog's models .*lab.train\(strategy, model="):
        run_ensemble(None, notebook["Net"])  # refused before the session is used


def test_flops_count_attention_where_its_shape_is_known(notebook):
    namespace = notebook
    tokens = namespace["tokens"]
    own, _ = pack_own(namespace["Net"], data=tokens)
    assert own.tokens_per_sample == 16 and own.attention is None
    assert own.training_flops_per_sample() == 6 * own.parameters * 16
    shaped, _ = pack_own(namespace["Net"], data=tokens, attention=dict(layers=2, dim=10))
    assert shaped.training_flops_per_sample() == 6 * own.parameters * 16 + 12 * 2 * 10 * 16 * 16
    with pytest.raises(LabConfigError, match=r"attention=dict\(layers=12, dim=768\)"):
        pack_own(namespace["Net"], data=tokens, attention=(2, 10))
    with pytest.raises(LabConfigError, match="not token ids"):
        pack_own(namespace["Net"], data=namespace["make_batch"], attention=dict(layers=2, dim=10))


def test_a_global_batch_larger_than_the_data_set_is_refused(notebook):
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(40, 4), torch.zeros(40, dtype=torch.long))
    settings, inspection = split_settings(dict(model=notebook["Net"], data=data, global_batch=1000))
    with pytest.raises(LabConfigError, match=r"global_batch=1000 is more samples than your data set has \(40\)"):
        check_run(inspection, resolve(4, **settings))
    settings, inspection = split_settings(dict(model=notebook["Net"], data=data))
    check_run(inspection, resolve(4, **settings))  # the default batch, 32, fits


def test_ipythons_own_open_is_never_sent_the_ranks_builtins_stand_in_its_place(notebook, monkeypatch):
    # A notebook's namespace holds IPython's own open (and exit, quit, In, Out...), kept in user_ns_hidden; a loss
    # that calls open() must not try to send it (it cannot travel): on the ranks, open is the rank's builtin.
    from IPython.core.interactiveshell import _modified_open  # the open IPython puts in every notebook

    class Shell:
        user_ns_hidden = {"open": _modified_open}

    monkeypatch.setattr("IPython.get_ipython", lambda: Shell())
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "open", _modified_open, raising=False)
    monkeypatch.setattr(main, "reads_a_file", None, raising=False)  # defined below; gone after the test
    source = "def reads_a_file(output, batch):\n    open\n    return output.sum()\n"
    exec(compile(source, "<ipython-input-open>", "exec"), vars(main))
    own, _ = pack_own(notebook["Net"], data=notebook["make_batch"], loss=vars(main)["reads_a_file"])
    assert "open" not in dict(own.travelled)
    exec(compile("def open(*args):\n    return None\n", "<ipython-input-own-open>", "exec"), vars(main))
    # The user's own open (defined in a cell) is theirs: it travels.
    own, _ = pack_own(notebook["Net"], data=notebook["make_batch"], loss=vars(main)["reads_a_file"])
    assert dict(own.travelled)["open"] == "by source"
