"""A script's logging lives as long as its run, as in a fresh process.

Python's ``logging`` is process state, and a rank runs many scripts in one
process: ``logging.basicConfig`` does nothing once the root logger has handlers,
so a script run after another would log to the first one's handlers, in its
format, even into its log file. Under torchrun each script starts with logging
unconfigured. So, while a script runs:

- the root logger is as a fresh process has it: no handlers, no filters, level
  WARNING; ``logging.disable`` is off;
- when the run ends, the root logger and every logger that existed before are
  put back as they were (level, handlers, filters, propagate, disabled), and the
  manager's settings (``logging.disable``, the logger class, the record factory,
  level names, ``captureWarnings``) too;
- the loggers the run created are left as a fresh ``getLogger`` makes them
  (level NOTSET, propagating, enabled, no filters). Their handlers go, except
  ``NullHandler``: a library imported during the run stays loaded and will not
  add its import-time ``NullHandler`` again;
- every handler the run made and no logger keeps is closed, so the files it
  opened are closed.

Runs in the engines.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field


@dataclass
class LoggerState:
    """What a script may change of one logger."""

    level: int
    handlers: list[logging.Handler]
    filters: list = field(default_factory=list)
    propagate: bool = True
    disabled: bool = False

    @classmethod
    def of(cls, logger: logging.Logger) -> LoggerState:
        return cls(logger.level, list(logger.handlers), list(logger.filters), logger.propagate, logger.disabled)

    def put_on(self, logger: logging.Logger) -> None:
        logger.level = self.level
        logger.handlers[:] = self.handlers
        logger.filters[:] = self.filters
        logger.propagate = self.propagate
        logger.disabled = self.disabled


# The root logger of a fresh process.
FRESH_ROOT = LoggerState(logging.WARNING, [])


def _loggers() -> dict[str, logging.Logger]:
    """Every logger by name (placeholders, which only hold children, left out)."""
    return {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
            if isinstance(logger, logging.Logger)}


def _all_handlers() -> set[logging.Handler]:
    """Every handler still alive that logging knows of (``logging._handlerList`` holds weak references)."""
    handler_list = getattr(logging, "_handlerList", [])
    return {handler for handler in (reference() for reference in list(handler_list)) if handler is not None}


@dataclass
class ManagerState:
    """The settings of the logging module itself that a script may change."""

    disable: int
    logger_class: type
    record_factory: object
    level_to_name: dict
    name_to_level: dict
    show_warning: object
    captured_show_warning: object
    raise_exceptions: bool

    @classmethod
    def now(cls) -> ManagerState:
        manager = logging.Logger.manager
        return cls(manager.disable, logging.getLoggerClass(), logging.getLogRecordFactory(),
                   dict(getattr(logging, "_levelToName", {})), dict(getattr(logging, "_nameToLevel", {})),
                   warnings.showwarning, getattr(logging, "_warnings_showwarning", None), logging.raiseExceptions)

    def put_back(self) -> None:
        logging.Logger.manager.disable = self.disable
        logging.setLoggerClass(self.logger_class)
        logging.setLogRecordFactory(self.record_factory)  # type: ignore[arg-type]
        for name, table in (("_levelToName", self.level_to_name), ("_nameToLevel", self.name_to_level)):
            current = getattr(logging, name, None)
            if isinstance(current, dict):
                current.clear()
                current.update(table)
        # ``logging.captureWarnings(True)`` swaps warnings.showwarning and remembers the original.
        warnings.showwarning = self.show_warning  # type: ignore[assignment]
        if hasattr(logging, "_warnings_showwarning"):
            logging._warnings_showwarning = self.captured_show_warning
        logging.raiseExceptions = self.raise_exceptions


def _clear_level_cache() -> None:
    # Loggers cache isEnabledFor answers; levels set directly (not through setLevel) need the cache emptied.
    clear = getattr(logging.Logger.manager, "_clear_cache", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def logging_of_the_run():
    """While a script runs: logging unconfigured as in a fresh process; as it was before, after."""
    root = logging.getLogger()
    manager = ManagerState.now()
    root_before = LoggerState.of(root)
    before = {name: LoggerState.of(logger) for name, logger in _loggers().items()}
    handlers_before = _all_handlers()
    FRESH_ROOT.put_on(root)
    logging.Logger.manager.disable = logging.NOTSET
    _clear_level_cache()
    try:
        yield
    finally:
        _put_back(root, root_before, before, handlers_before, manager)


def _put_back(root: logging.Logger, root_before: LoggerState, before: dict[str, LoggerState],
              handlers_before: set[logging.Handler], manager: ManagerState) -> None:
    root_before.put_on(root)
    for name, logger in _loggers().items():
        if name in before:
            before[name].put_on(logger)
        else:
            kept: list[logging.Handler] = [handler for handler in logger.handlers
                                           if isinstance(handler, logging.NullHandler)]
            LoggerState(logging.NOTSET, kept).put_on(logger)
    manager.put_back()
    _clear_level_cache()
    _close_the_runs_handlers(handlers_before)


def _close_the_runs_handlers(handlers_before: set[logging.Handler]) -> None:
    """Close the handlers the run made that no logger keeps (its log files among them)."""
    kept = set(logging.getLogger().handlers)
    for logger in _loggers().values():
        kept.update(logger.handlers)
    closed = _all_handlers() - handlers_before - kept
    for handler in closed:
        try:
            handler.flush()
            handler.close()
        except Exception:  # noqa: BLE001 - a handler broken by the script must not fail the lab's clean-up
            pass
    # Gone from logging's list as from a fresh process's: logging.shutdown() at exit must not meet them.
    handler_list = getattr(logging, "_handlerList", None)
    if isinstance(handler_list, list):
        handler_list[:] = [reference for reference in handler_list if reference() not in closed]
