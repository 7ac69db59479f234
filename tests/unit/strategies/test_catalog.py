"""The catalogs: a strategy or a model is one declaration, found by entry points; the rest reads them (no ranks)."""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from labkit.magics.train_args import train_parser
from labkit.runs.budget import sharded_estimates  # noqa: F401 - imports the catalog's consumer
from labkit.spec.train_config import resolve, user_settings
from labkit.strategies.catalog import (
    AXIS_ORDER,
    CATALOG,
    Setting,
    Strategy,
    axes_of,
    parse_strategy,
    refresh_strategies,
    register,
    role_of,
    settings_by_name,
    sharding_alternatives,
    strategies,
    strategy,
    strategy_names,
    strategy_notes,
    unregister,
)
from labkit.strategies.ddp import BUCKET_CAP_MB
from labkit.strategies.rank_side import rank_module
from labkit.magics.parsing import HelpShown
from labkit.zoo import plugins
from labkit.zoo.catalog import model, model_names, model_notes, refresh_models
from labkit.zoo.plugins import PluginError

from tests.plugins.installed import fake_distribution, on_path

BUILT_IN = ("ddp", "fsdp", "tp", "pp", "ps", "diloco")


def test_the_built_ins_are_found_in_labkits_own_code():
    assert strategy_names()[:len(BUILT_IN)] == BUILT_IN  # in list order
    assert model_names()[:2] == ("mlp", "gpt")
    assert list(CATALOG) == list(strategy_names()) and CATALOG["ddp"] is strategy("ddp")


def test_the_built_ins_need_no_package_metadata(monkeypatch):
    # A checkout on PYTHONPATH, not installed: no labkit metadata, so no entry points at all.
    monkeypatch.setattr(plugins, "distributions", lambda: [])
    refresh_strategies()
    refresh_models()
    try:
        assert strategy_names() == BUILT_IN and model_names() == ("mlp", "gpt")
        assert resolve(4, strategy="fsdp+tp", model="gpt").parts == ("fsdp", "tp")
        with pytest.raises(ValueError, match=r"unknown strategy 'zero3': use ddp, fsdp, tp, pp, ps, diloco or"):
            parse_strategy("zero3")
    finally:
        monkeypatch.undo()
        refresh_strategies()
        refresh_models()


def test_a_checkout_on_the_path_alone_lists_the_built_ins(tmp_path):
    # python -S: no site-packages, so neither labkit's metadata nor any package's; labkit from PYTHONPATH.
    probe = ("from labkit.strategies.catalog import strategy_names\nfrom labkit.zoo.catalog import model_names\n"
             "print(','.join(strategy_names()), ','.join(model_names()))")
    checkout = str(pathlib.Path(__file__).parents[3])
    done = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={"PYTHONPATH": checkout, "PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [",".join(BUILT_IN), "mlp,gpt"]


def test_every_strategy_has_a_rank_module_with_apply_beside_its_declaration():
    for name, entry in strategies().items():
        module = rank_module(entry)
        assert callable(module.apply), name
        assert getattr(module, "STRATEGY", entry) == entry  # the built-ins declare themselves in that module
        assert entry.axis in AXIS_ORDER


def test_every_declaration_loads_without_torch():
    probe = ("import sys\nfrom labkit.strategies.catalog import strategies\nfrom labkit.zoo.catalog import model, "
             "model_names\nstrategies()\n[model(name).settings_for() for name in model_names()]\n"
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_compositions_are_parsed_against_the_catalog():
    assert parse_strategy("FSDP + tp") == ("fsdp", "tp")
    assert axes_of(("tp", "ddp", "pp")) == ["pp", "dp", "tp"]
    with pytest.raises(ValueError, match="both use the dp axis"):
        parse_strategy("ddp+fsdp")
    with pytest.raises(ValueError, match="names a part twice"):
        parse_strategy("tp+tp")
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3': use ddp, fsdp, tp, pp, ps, diloco.*"
                                         r"pip install it.*\[project.entry-points.\"labkit.strategies\"\]"):
        parse_strategy("zero3")
    with pytest.raises(ValueError, match="a strategy is a name"):
        parse_strategy(3)


def test_a_strategys_settings_get_its_defaults_and_only_its_composition_takes_them():
    config = resolve(4, strategy="ddp+pp", model="mlp")
    assert config.options == {"bucket_cap_mb": 25.0, "schedule": "1f1b"}
    assert config.setting(BUCKET_CAP_MB) == 25.0 == config.setting("bucket_cap_mb")
    assert config.micro_batches == 2  # pp's default: one per stage
    with pytest.raises(LookupError, match="no setting 'sequence_parallel': it is tp's, and 'ddp\\+pp' does not use"):
        config.setting("sequence_parallel")
    with pytest.raises(AttributeError):
        config.bucket_cap_mb  # noqa: B018 - settings are read through config.setting, never as attributes
    with pytest.raises(ValueError, match="bucket_cap_mb is a setting of ddp"):
        resolve(4, strategy="fsdp", bucket_cap_mb=10.0)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag' for pp"):
        resolve(4, strategy="pp", schedule="zigzag")
    with pytest.raises(ValueError, match="reshard_after_forward .* True or False"):
        resolve(4, strategy="fsdp", reshard_after_forward="no")


def test_setting_names_do_not_collide():
    owned = [setting.name for entry in CATALOG.values() for setting in entry.settings]
    assert len(owned) == len(set(owned))
    assert not set(owned) & user_settings()


def test_the_magics_offer_every_catalog_setting():
    parser = train_parser()
    offered = {action.dest: action for action in parser._actions}
    for name, (owner, setting) in settings_by_name().items():
        assert name in offered, f"%lab train has no option for {owner}'s {name}"
        assert setting.option in offered[name].option_strings
    given = vars(parser.parse_args(["--strategy", "fsdp", "--no-reshard"]))
    assert given == {"strategy": "fsdp", "reshard_after_forward": False}  # only what was given
    assert vars(parser.parse_args(["--schedule", "gpipe"]))["schedule"] == "gpipe"


def test_budget_alternatives_are_the_memory_dividing_entries():
    assert sharding_alternatives() == ("fsdp", "tp", "pp")


def test_ranks_are_trainers_unless_a_strategy_gives_roles():
    config = resolve(4, strategy="ddp")
    assert {role_of(config.parts, config, rank) for rank in range(4)} == {"trainer"}


MINE = Strategy("mine", axis="dp", order=2, module="labkit.strategies.ddp", summary="ddp by another name")


def test_a_strategy_declared_in_a_running_notebook_is_registered_and_unregistered():
    register(MINE)
    try:
        assert strategy("mine") is MINE and "mine" in strategy_names()
        assert resolve(4, strategy="mine").parts == ("mine",)
        register(MINE)  # the same one again is fine
    finally:
        unregister("mine")
    assert "mine" not in strategy_names()
    with pytest.raises(ValueError, match="unknown strategy 'mine'"):
        parse_strategy("mine")
    with pytest.raises(PluginError, match="'ddp' is installed \\(package labkit\\), not added .* uninstall"):
        unregister("ddp")


def test_registering_a_strategy_refuses_clashes():
    with pytest.raises(ValueError, match="already called 'ddp'"):
        register(Strategy("ddp", axis="dp", order=2, summary="another ddp"))
    with pytest.raises(ValueError, match="bucket_cap_mb belong to other strategies"):
        register(replace(MINE, settings=(Setting("bucket_cap_mb", 1.0, "x"),)))
    with pytest.raises(ValueError, match="axis 'ep' is not one of"):
        register(replace(MINE, name="experts", axis="ep"))
    assert "mine" not in CATALOG and "experts" not in CATALOG
    register(CATALOG["ddp"])  # the same entry again is fine


# A package's declaration, as a module of its own (torch-free, as the notebook reads it).
PACKAGED = '''
from labkit.strategies.catalog import Strategy
STRATEGY = Strategy("{name}", axis="dp", order=2, module="labkit.strategies.ddp", summary="{summary}")
'''


def test_an_installed_packages_strategy_is_found_with_no_call_and_gone_once_uninstalled(tmp_path):
    fake_distribution(tmp_path, "lab-extras", {"labkit.strategies": {"twin": "lab_extras:STRATEGY"}},
                      {"lab_extras": PACKAGED.format(name="twin", summary="one package's")})
    assert "twin" not in strategy_names()
    with on_path(tmp_path):
        assert strategy("twin").summary == "one package's"
        assert strategy("twin").module == "labkit.strategies.ddp"  # where its apply is, as declared
        assert resolve(4, strategy="twin").mesh.describe() == "dp=4"
    assert "twin" not in strategy_names()


def test_a_name_two_packages_declare_is_refused_naming_both(tmp_path):
    for package in ("lab-extras", "more-extras"):
        module = package.replace("-", "_")
        fake_distribution(tmp_path, package, {"labkit.strategies": {"twin": f"{module}:STRATEGY"}},
                          {module: PACKAGED.format(name="twin", summary=package)})
    with on_path(tmp_path):
        with pytest.raises(PluginError, match=r"two installed packages declare the strategy 'twin': "
                                              r"(lab-extras|more-extras) .*; (lab-extras|more-extras) .*"
                                              r"pip uninstall one of lab-extras, more-extras"):
            strategy("twin")
        assert strategy("ddp").name == "ddp"  # the other strategies are unaffected


def test_a_name_no_package_declares_says_which_are_known_and_how_to_install_one():
    with pytest.raises(PluginError, match=r"no strategy is called 'nope'; the known ones are ddp, fsdp, tp, pp, "
                                          r"ps, diloco.*pip install it"):
        strategy("nope")
    with pytest.raises(ValueError, match=r"unknown model 'resnet': choose one of mlp, gpt.*labkit.models"):
        model("resnet")


def test_a_declaration_that_does_not_match_its_entry_point_is_refused(tmp_path):
    fake_distribution(tmp_path, "odd-extras", {"labkit.strategies": {"odd": "odd_extras:STRATEGY",
                                                                     "broken": "odd_extras:MISSING"}},
                      {"odd_extras": PACKAGED.format(name="other", summary="misnamed")})
    with on_path(tmp_path):
        with pytest.raises(PluginError, match="calls itself 'other': the entry point and the declaration"):
            strategy("odd")
        with pytest.raises(PluginError, match="'broken' of package odd-extras .* does not load: AttributeError"):
            strategy("broken")


def test_a_package_installed_after_the_first_read_is_found(tmp_path):
    assert "late" not in strategy_names()  # the catalog has read the installed packages
    with on_path(tmp_path):
        assert "late" not in strategy_names()
        fake_distribution(tmp_path, "late-extras", {"labkit.strategies": {"late": "late_extras:STRATEGY"}},
                          {"late_extras": PACKAGED.format(name="late", summary="installed later")})
        assert strategy("late").summary == "installed later"  # an unknown name reads them again


def test_an_old_copy_of_labkits_metadata_first_on_the_path_hides_no_built_in(tmp_path):
    # What an earlier install leaves in a checkout: labkit's metadata with no strategies or models,
    # first on the path wherever Python runs from there. The installed copy's declarations still count.
    fake_distribution(tmp_path, "labkit", {"console_scripts": {"labkit": "labkit.__main__:main"}})
    with on_path(tmp_path):
        assert importlib.metadata.entry_points(group="labkit.strategies").names == set()  # what it hides
        assert strategy_names()[:3] == ("ddp", "fsdp", "tp") and "gpt" in model_names()
        assert strategy("ddp").name == "ddp"


# -- a broken plugin breaks only itself ----------------------------------------------------------------------

BROKEN_AT_IMPORT = "raise RuntimeError('the plugin cannot start')\n"
A_MODEL = '''
from labkit.zoo.catalog import ModelDeclaration
from labkit.zoo.mlp import MODEL as MLP
MODEL = ModelDeclaration("{name}", "{summary}", MLP.settings, MLP.network, MLP.data, MLP.loss)
'''


def test_a_strategy_plugin_that_does_not_load_breaks_only_itself(tmp_path):
    fake_distribution(tmp_path, "bad-extras", {"labkit.strategies": {"broken": "bad_extras:STRATEGY",
                                                                     "missing": "good_extras:MISSING",
                                                                     "garbled": ":::"}},
                      {"bad_extras": BROKEN_AT_IMPORT})
    fake_distribution(tmp_path, "good-extras", {"labkit.strategies": {"twin": "good_extras:STRATEGY"}},
                      {"good_extras": PACKAGED.format(name="twin", summary="works")})
    with on_path(tmp_path):
        assert strategy_names() == (*BUILT_IN, "twin")  # the built-ins and the other plugin work
        assert resolve(4, strategy="ddp", model="mlp").parts == ("ddp",)
        assert resolve(4, strategy="twin").parts == ("twin",)
        assert train_parser().parse_args(["--strategy", "ddp"]).strategy == "ddp"
        with pytest.raises(PluginError, match=r"the strategy 'broken' of package bad-extras \(bad_extras:STRATEGY\) "
                                              r"does not load: RuntimeError: the plugin cannot start; the other "
                                              r"strategies work. To be rid of it: pip uninstall bad-extras"):
            resolve(4, strategy="broken")
        with pytest.raises(PluginError, match=r"'missing' .* does not load: AttributeError.*pip uninstall bad-extras"):
            strategy("missing")
        with pytest.raises(PluginError, match=r"the strategy 'garbled' of package bad-extras is declared as ':::', "
                                              r"which is no 'module:attribute' .*pip uninstall bad-extras"):
            strategy("garbled")
        with pytest.raises(PluginError, match=r"unknown strategy 'zero3': use ddp, .*, twin or .* Installed but not "
                                              r"loading: broken, garbled, missing"):
            parse_strategy("zero3")
        notes = strategy_notes()
        assert len(notes) == 3 and all("pip uninstall bad-extras" in note for note in notes)
        assert "RuntimeError: the plugin cannot start" in " ".join(notes)


def test_a_broken_model_plugin_leaves_a_mistyped_name_unknown(tmp_path):
    fake_distribution(tmp_path, "bad-models",
                      {"labkit.models": {"crash": "bad_models:MODEL", "tiny": "tiny_one:MODEL"}},
                      {"bad_models": BROKEN_AT_IMPORT, "tiny_one": A_MODEL.format(name="tiny", summary="fine")})
    with on_path(tmp_path):
        with pytest.raises(PluginError, match=r"unknown model 'resnet': choose one of mlp, gpt, tiny\. Installed but "
                                              r"not loading: crash"):
            model("resnet")
        with pytest.raises(PluginError, match=r"'crash' of package bad-models .* RuntimeError: the plugin cannot "
                                              r"start.*pip uninstall bad-models"):
            model("crash")
        assert model("tiny").summary == "fine" and resolve(4, strategy="ddp", model="mlp").model == "mlp"
        assert [note.split(" (")[0] for note in model_notes()] == ["the model 'crash' of package bad-models"]


def test_train_help_names_the_plugins_that_do_not_load(tmp_path, capsys):
    fake_distribution(tmp_path, "bad-extras", {"labkit.strategies": {"broken": "bad_extras:STRATEGY"}},
                      {"bad_extras": BROKEN_AT_IMPORT})
    with on_path(tmp_path):
        with pytest.raises(HelpShown):
            train_parser().parse_args(["--help"])
    said = capsys.readouterr().out
    assert re.search(r"--strategy S +ddp, fsdp, tp, pp, ps, diloco or a composition", said)
    assert "Installed but not used:\n  the strategy 'broken' of package bad-extras" in said
    assert "pip uninstall bad-extras" in said


def test_a_plugin_cannot_take_a_built_ins_name_or_setting(tmp_path):
    fake_distribution(tmp_path, "rogue-extras", {"labkit.strategies": {"ddp": "rogue_extras:STRATEGY",
                                                                       "bucketed": "rogue_bucketed:STRATEGY"}},
                      {"rogue_extras": PACKAGED.format(name="ddp", summary="not labkit's"),
                       "rogue_bucketed": PACKAGED.replace('summary="{summary}"',
                                                          'summary="x", settings=(Setting("bucket_cap_mb", 1.0, "x"),)')
                       .replace("import Strategy", "import Setting, Strategy").format(name="bucketed")})
    with on_path(tmp_path):
        assert strategy("ddp").summary != "not labkit's" and strategy("ddp").module_name == "labkit.strategies.ddp"
        assert strategy_names() == BUILT_IN
        assert settings_by_name()["bucket_cap_mb"][0] == "ddp"
        with pytest.raises(PluginError, match=r"'bucketed' has settings another strategy has: bucket_cap_mb "
                                              r"\(ddp's\).*pip uninstall rogue-extras"):
            strategy("bucketed")
        notes = " ".join(strategy_notes())
        assert "rogue-extras also declares a strategy 'ddp' (rogue_extras:STRATEGY); labkit's own is used" in notes
