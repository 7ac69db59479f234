"""Argument parsing of the magics: sizes, durations, settings (no processes)."""

import argparse

import pytest
from IPython.core.error import UsageError

from labkit.magics import _duration, _settings, _size_range


def test_size_ranges_are_powers_of_two_in_binary_units():
    assert _size_range("1KB:8KB") == [1024, 2048, 4096, 8192]
    assert _size_range("4KiB:4MB")[-1] == 4 * 2**20
    assert _size_range("512:2KB") == [512, 1024, 2048]
    assert _size_range("64KB") == [65536]
    with pytest.raises(argparse.ArgumentTypeError, match="like 4KB"):
        _size_range("lots")


def test_durations():
    assert _duration("30ms") == pytest.approx(0.03)
    assert _duration("0.5s") == 0.5 and _duration("2") == 2.0
    assert _duration("off") is None
    with pytest.raises(UsageError, match="30ms"):
        _duration("soon")


def test_model_settings():
    assert _settings("dim=128,layers=8") == {"dim": 128, "layers": 8}
    assert _settings("dims=64") == {"dims": 64}
    with pytest.raises(argparse.ArgumentTypeError, match="name=value"):
        _settings("dim")
