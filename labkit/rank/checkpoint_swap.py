"""Putting a complete checkpoint in place of the old one so that a kill at any instant loses neither.

On Linux the two folders are exchanged in one step (``renameat2`` with
``RENAME_EXCHANGE``): before it the old checkpoint is at the path, after it the new
one is, and the old one, now in the work folder, is removed. Where the system or the
file system cannot exchange (another OS, some network file systems), the old
checkpoint is renamed aside and the new one renamed into place; a kill between the
two renames leaves the path missing and both checkpoints whole beside it, and
``checkpoint_files.recoverable`` finds the new one for a load, as the next save does.
"""

from __future__ import annotations

import ctypes
import errno
import os

from labkit.spec.checkpoint_files import aside_directory, remove_checkpoint

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What renameat2 answers when this kernel or file system cannot exchange: fall back to two renames.
_CANNOT_EXCHANGE = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)


def _renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library older than glibc 2.28
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def exchange(first: str, second: str) -> bool:
    """Swap two existing paths in one step; False (nothing changed) where the system cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def move(source: str, destination: str) -> None:
    """One rename (its own function so that a test can stop a process between two of them)."""
    os.rename(source, destination)


def put_in_place(partial: str, target: str) -> None:
    """Make the complete checkpoint ``partial`` the one at ``target`` (absent, an empty folder, or an old
    checkpoint, as ``save_refusal`` allowed), and remove the old one."""
    if not os.path.lexists(target) or not os.listdir(target):
        move(partial, target)  # a rename replaces an empty folder in one step, and fails on one that is not
        return
    if exchange(partial, target):
        remove_checkpoint(partial)  # the old checkpoint, now under the work folder's name
        return
    aside = aside_directory(partial)
    move(target, aside)
    move(partial, target)
    remove_checkpoint(aside)
