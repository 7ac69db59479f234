"""The strategy catalog is the one declaration of each strategy; everything else reads it (no processes)."""

import importlib

import pytest

from labkit.magic_parsers import train_parser as _train_parser
from labkit.runs.budget import sharded_estimates  # noqa: F401 - imports the catalog's consumer
from labkit.spec.train_config import resolve, user_settings
from labkit.strategies.catalog import (
    AXIS_ORDER,
    CATALOG,
    axes_of,
    parse_strategy,
    role_of,
    settings_by_name,
    sharding_alternatives,
)


def test_every_entry_has_a_rank_module_with_apply():
    for entry in CATALOG.values():
        module = importlib.import_module(entry.module_name)
        assert callable(getattr(module, "apply", None)), entry.name
        assert entry.axis in AXIS_ORDER


def test_compositions_are_parsed_against_the_catalog():
    assert parse_strategy("FSDP + tp") == ("fsdp", "tp")
    assert axes_of(("tp", "ddp", "pp")) == ["pp", "dp", "tp"]
    with pytest.raises(ValueError, match="both use the dp axis"):
        parse_strategy("ddp+fsdp")
    with pytest.raises(ValueError, match="names a part twice"):
        parse_strategy("tp+tp")
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategy("zero3")
    with pytest.raises(ValueError, match="a strategy is a name"):
        parse_strategy(3)


def test_a_strategys_settings_get_its_defaults_and_only_its_composition_takes_them():
    config = resolve(4, strategy="ddp+pp", model="mlp")
    assert config.options == {"bucket_cap_mb": 25.0, "schedule": "1f1b"}
    assert config.bucket_cap_mb == 25.0 and config.micro_batches == 2  # pp's default: one per stage
    with pytest.raises(AttributeError):
        config.sequence_parallel
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
    parser = _train_parser()
    offered = {action.dest: action for action in parser._actions}
    for name, (owner, setting) in settings_by_name().items():
        assert name in offered, f"%lab train has no option for {owner}'s {name}"
        assert setting.option in offered[name].option_strings
    given = vars(parser.parse_args(["--strategy", "fsdp", "--no-reshard"]))
    assert given == {"strategy": "fsdp", "reshard_after_forward": False}  # only what was given
    assert vars(parser.parse_args(["--schedule", "gpipe"]))["schedule"] == "gpipe"


def test_budget_alternatives_are_the_memory_dividing_entries():
    assert set(sharding_alternatives()) == {"fsdp", "tp", "pp"}


def test_ranks_are_trainers_unless_a_strategy_gives_roles():
    config = resolve(4, strategy="ddp")
    assert {role_of(config.parts, config, rank) for rank in range(4)} == {"trainer"}


def test_registering_a_strategy_refuses_clashes():
    from labkit.strategies.catalog import Setting, Strategy, register

    with pytest.raises(ValueError, match="already called 'ddp'"):
        register(Strategy("ddp", axis="dp", order=2, summary="another ddp"))
    with pytest.raises(ValueError, match="bucket_cap_mb belong to other strategies"):
        register(Strategy("mine", axis="dp", order=2, summary="x", settings=(Setting("bucket_cap_mb", 1.0, "x"),)))
    with pytest.raises(ValueError, match="axis 'ep' is not one of"):
        register(Strategy("experts", axis="ep", order=2, summary="x"))
    assert "mine" not in CATALOG and "experts" not in CATALOG
    register(CATALOG["ddp"])  # the same entry again is fine
