"""The catalogs: a strategy or a model is one declaration, found by entry points; the rest reads them (no ranks)."""

import importlib.metadata
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
    register,
    role_of,
    settings_by_name,
    sharding_alternatives,
    strategies,
    strategy,
    strategy_names,
    unregister,
)
from labkit.strategies.ddp import BUCKET_CAP_MB
from labkit.strategies.rank_side import rank_module
from labkit.zoo.catalog import model, model_names
from labkit.zoo.plugins import PluginError

from tests.plugins.installed import fake_distribution, on_path

BUILT_IN = ("ddp", "fsdp", "tp", "pp", "ps", "diloco")


def test_the_built_ins_are_found_by_labkits_own_entry_points():
    declared = {point.name: point.value for point in importlib.metadata.entry_points(group="labkit.strategies")
                if point.dist is not None and point.dist.name == "labkit"}
    assert declared == {name: f"labkit.strategies.{name}:STRATEGY" for name in BUILT_IN}
    assert strategy_names()[:len(BUILT_IN)] == BUILT_IN  # in list order, whatever order pip wrote them in
    assert model_names()[:2] == ("mlp", "gpt")
    assert list(CATALOG) == list(strategy_names()) and CATALOG["ddp"] is strategy("ddp")


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
                                              r"(lab-extras|more-extras) .*; (lab-extras|more-extras) .*Uninstall one"):
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
