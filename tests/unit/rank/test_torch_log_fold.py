"""Exceptions torch logs before raising them are folded into the error a run reports (``rank.torch_log_fold``)."""

import io
import logging

import pytest

from labkit.rank import torch_log_fold
from labkit.rank.torch_log_fold import torch_exceptions_folded

NAME = "torch._subclasses.labkit_test"  # a torch logger with a handler of its own, as torch gives many


def log_an_exception() -> None:
    try:
        raise RuntimeError("a and b must have same reduction dim")
    except RuntimeError:
        logging.getLogger(NAME).exception("failed while attempting to run meta for %s", "aten.mm.default")


@pytest.fixture()
def printed():
    """What the torch logger's own handler prints (torch's handlers write to stderr)."""
    stream = io.StringIO()
    logger = logging.getLogger(NAME)
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    yield stream
    logger.removeHandler(handler)
    logger.propagate = True


@pytest.fixture()
def log_file(monkeypatch):
    written: list[str] = []
    monkeypatch.setattr(torch_log_fold, "write_to_log", written.append)
    return written


def test_a_logged_exception_is_held_back_and_named_in_the_error_that_follows(printed, log_file):
    with pytest.raises(RuntimeError) as raised, torch_exceptions_folded():
        log_an_exception()
        log_an_exception()
        raise RuntimeError("a and b must have same reduction dim")
    assert printed.getvalue() == ""  # nothing printed beside the error
    assert raised.value.__notes__ == ["torch logged 2 exceptions on this rank before it (their tracebacks are in "
                                      "the rank's log): failed while attempting to run meta for aten.mm.default"]
    assert len(log_file) == 1 and log_file[0].count("Traceback (most recent call last)") == 2


def test_other_records_pass_and_the_filters_go_when_the_block_ends(printed, log_file):
    with torch_exceptions_folded():
        logging.getLogger(NAME).error("a message of torch's own, no exception")
    assert "a message of torch's own" in printed.getvalue()
    log_an_exception()  # outside a run: printed as torch prints it
    assert "failed while attempting" in printed.getvalue()
    assert log_file == []
