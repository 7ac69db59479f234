"""Torch's logged exceptions during a run, folded into the error the rank reports instead of printed beside it.

Some of torch's code logs an exception it is about to raise again: a wrong
tensor-parallel plan makes DTensor's shape propagation log "failed while
attempting to run meta for aten.mm.default" with its whole traceback (about 20
lines a rank) on stderr, which the notebook shows before the lab's own report
of the very same error. While a run trains (``rank.loop.train``) such records
(a ``torch`` logger, level ERROR or above, with an exception attached) are held
back: when the run then fails, the error carries one line naming what torch
logged; their full text goes to the rank's log file, not to the notebook. What
torch logs without an exception (warnings, its own messages) passes as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

_SHOWN = 3  # how many distinct messages the error's line names


class _HeldExceptions(logging.Filter):
    """A filter on torch's handlers that keeps back the records of exceptions torch logs before raising them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torch") and record.levelno >= logging.ERROR and record.exc_info:
            if record not in self.records:  # one record passes every handler: keep it once
                self.records.append(record)
            return False
        return True

    def summary(self) -> str:
        messages = list(dict.fromkeys(record.getMessage() for record in self.records))
        more = f" and {len(messages) - _SHOWN} more" if len(messages) > _SHOWN else ""
        count = len(self.records)
        return (f"torch logged {count} exception{'s' if count > 1 else ''} on this rank before it (their "
                f"tracebacks are in the rank's log): {'; '.join(messages[:_SHOWN])}{more}")

    def text(self) -> str:
        formatter = logging.Formatter("%(name)s %(levelname)s: %(message)s")
        return "".join(formatter.format(record) + "\n" for record in self.records)


@contextlib.contextmanager
def torch_exceptions_folded() -> Iterator[None]:
    """Hold back the exceptions torch logs in the block; an error leaving it names them in a note."""
    held = _HeldExceptions()
    handlers = _torch_handlers()
    for handler in handlers:
        handler.addFilter(held)
    try:
        yield
    except BaseException as error:
        if held.records:
            error.add_note(held.summary())
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(held)
        if held.records:
            write_to_log(held.text())


def _torch_handlers() -> list[logging.Handler]:
    """Every handler a record of a torch logger can reach: torch gives many of its loggers handlers of their own
    and stops them propagating, so each is looked at; Python's last resort where a record reaches none."""
    loggers = [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
               if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger)]
    found: dict[int, logging.Handler] = {}
    for logger in loggers or [logging.getLogger("torch")]:
        current: logging.Logger | None = logger
        while current is not None:
            found.update((id(handler), handler) for handler in current.handlers)
            current = current.parent if current.propagate else None
    if logging.lastResort is not None:
        found[id(logging.lastResort)] = logging.lastResort
    return list(found.values())


def write_to_log(text: str) -> None:
    """Write ``text`` to the rank's log file without it reaching the notebook: an engine's stderr is forwarded
    to the notebook, and ipykernel keeps a copy of the descriptor it had before, the log's. Elsewhere (a
    process of torchrun's) to stderr."""
    original = getattr(sys.stderr, "_original_stdstream_copy", None)
    if isinstance(original, int):
        try:
            os.write(original, text.encode("utf-8", "replace"))
            return
        except OSError:
            pass  # closed: stderr, as a plain process would
    stream = sys.__stderr__ or sys.stderr
    stream.write(text)
    stream.flush()
