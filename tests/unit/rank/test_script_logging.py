"""A script's logging lives as long as its run (``labkit.rank.script_logging``), in this process."""

import contextlib
import logging
import logging.config
import warnings

from labkit.rank.script_logging import logging_of_the_run


@contextlib.contextmanager
def clean_root():
    """pytest's own capture handlers off the root while a test runs its scripts; back after."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    root.handlers[:] = []
    root.setLevel(logging.WARNING)
    try:
        yield root
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_the_next_scripts_basicconfig_works_and_the_first_ones_file_is_closed(tmp_path):
    with clean_root() as root:
        first, second = tmp_path / "first.log", tmp_path / "second.log"
        with logging_of_the_run():
            logging.basicConfig(filename=first, format="first %(message)s", level=logging.INFO)
            logging.info("one")
            opened = logging.getLogger().handlers[0]
        assert root.handlers == [] and root.level == logging.WARNING
        assert opened.stream is None  # closed: a FileHandler's stream goes with close()
        with logging_of_the_run():
            logging.basicConfig(filename=second, format="second %(message)s", level=logging.INFO)
            logging.info("two")
        assert first.read_text() == "first one\n"
        assert second.read_text() == "second two\n"
        assert all(reference() is not opened for reference in logging._handlerList)


def test_a_script_starts_unconfigured_and_the_notebooks_logging_comes_back():
    with clean_root() as root:
        notebooks = logging.StreamHandler()
        root.addHandler(notebooks)
        root.setLevel(logging.DEBUG)
        logging.disable(logging.CRITICAL)
        try:
            with logging_of_the_run():
                assert root.handlers == [] and root.level == logging.WARNING
                assert logging.root.manager.disable == logging.NOTSET
                logging.disable(logging.INFO)
            assert root.handlers == [notebooks] and root.level == logging.DEBUG
            assert logging.root.manager.disable == logging.CRITICAL
            assert notebooks.stream is not None  # not the run's: left open
        finally:
            logging.disable(logging.NOTSET)


def test_loggers_that_existed_come_back_and_the_runs_own_are_fresh():
    with clean_root() as root:
        existing = logging.getLogger("labkit_test.existing")
        existing.setLevel(logging.ERROR)
        kept = logging.NullHandler()
        existing.addHandler(kept)
        with logging_of_the_run():
            # dictConfig disables the loggers it does not name, as hydra's job logging does.
            logging.config.dictConfig({"version": 1, "root": {"level": "INFO"}})
            existing.setLevel(logging.DEBUG)
            existing.propagate = False
            existing.addHandler(logging.StreamHandler())
            own = logging.getLogger("labkit_test.own")
            own.setLevel(logging.DEBUG)
            own.propagate = False
            own.addHandler(logging.StreamHandler())
            library_null = logging.NullHandler()
            own.addHandler(library_null)
            logging.addLevelName(25, "NOTICE")
            logging.captureWarnings(True)
        assert (existing.level, existing.handlers, existing.propagate, existing.disabled) == \
            (logging.ERROR, [kept], True, False)
        assert (own.level, own.handlers, own.propagate, own.disabled) == (logging.NOTSET, [library_null], True, False)
        assert logging.getLevelName(25) == "Level 25"
        assert warnings.showwarning is not logging._showwarning
        assert own.isEnabledFor(logging.WARNING) and not own.isEnabledFor(logging.INFO)  # the level cache emptied

