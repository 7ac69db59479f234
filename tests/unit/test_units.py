"""Sizes and durations (``labkit.units``), and the magics that read them (no processes)."""

import argparse
import math

import pytest
from IPython.core.error import UsageError

from labkit.magics.values import duration, name_values, size_range
from labkit.units import (
    format_binary,
    format_bytes,
    parse_bytes,
    parse_duration,
    positive_seconds,
    power_of_two_range,
)


def test_si_units_are_decimal_and_iec_units_binary():
    assert parse_bytes("64MB") == 64_000_000
    assert parse_bytes("64 MiB") == 64 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("2kib") == 2048 and parse_bytes("3kB") == 3000
    assert parse_bytes("500000") == 500_000
    assert parse_bytes(4096) == 4096 and parse_bytes(None) is None


@pytest.mark.parametrize("text", ["lots", "64M", "-1MB", "0", "0.0001B", "", "1e6"])
def test_unreadable_or_empty_sizes_are_refused_with_an_example(text):
    with pytest.raises(ValueError, match="64MB|positive|at least one byte"):
        parse_bytes(text)


@pytest.mark.parametrize("value", [0, -5, True, 3.5, [1]])
def test_sizes_that_are_not_positive_integers_are_refused(value):
    with pytest.raises(ValueError):
        parse_bytes(value)


def test_train_and_magics_read_a_size_the_same_way():
    # The bench's message sizes are powers of two: 4MB (4,000,000) rounds to 4 MiB, the nearest one.
    assert power_of_two_range("4KB:4MB") == [2**p for p in range(12, 23)]
    assert size_range("4KiB:4MiB") == power_of_two_range("4KB:4MB")
    assert size_range("512:2KB") == [512, 1024, 2048]
    assert size_range("64KB") == [65536]
    with pytest.raises(argparse.ArgumentTypeError, match="64MB"):
        size_range("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="ends below"):
        size_range("4MB:4KB")


def test_formatting():
    assert format_bytes(12_800_000) == "12.8 MB" and format_bytes(900) == "900 B"
    assert format_binary(4096) == "4 KiB" and format_binary(3 * 2**20) == "3 MiB" and format_binary(100) == "100 B"


def test_durations():
    assert parse_duration("30ms") == pytest.approx(0.03)
    assert parse_duration("0.5s") == 0.5 and parse_duration("2") == 2.0
    assert parse_duration("off") is None and parse_duration("0ms") is None
    for bad in ("soon", "inf", "-3s", "nan"):
        with pytest.raises(ValueError, match="30ms|finite"):
            parse_duration(bad)
    assert duration("30ms") == pytest.approx(0.03)
    with pytest.raises(UsageError, match="30ms"):
        duration("soon")


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, True, "5"])
def test_time_limits_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="positive, finite"):
        positive_seconds("timeout", value)
    assert positive_seconds("timeout", 2) == 2.0


def test_model_settings():
    assert name_values("dim=128,layers=8") == {"dim": 128, "layers": 8}
    assert name_values("dims=64") == {"dims": 64}
    with pytest.raises(argparse.ArgumentTypeError, match="name=value"):
        name_values("dim")
