"""The rank this process is: where its runtime lives, and how code in a module reaches it.

Importable on both sides without torch. The runtime (``rank.runtime.RankRuntime``)
sits in the engine's IPython namespace under ``RUNTIME_NAME``; code in a module
(which does not see that namespace) asks ``this_rank()``.
"""

from __future__ import annotations

RUNTIME_NAME = "__labkit__"


def this_rank():
    """Inside a rank: its runtime (``.rank``, ``.world_size``, ``.mesh``, ``.device``, ``.state``).

    For functions defined in modules, which do not see the rank's namespace.
    """
    from IPython import get_ipython

    shell = get_ipython()
    namespace = shell.user_ns if shell is not None else {}
    if RUNTIME_NAME not in namespace:
        problem = namespace.get("__labkit_install_error__", "the engine was not started by labkit")
        raise RuntimeError(f"this engine has no labkit runtime:\n{problem}")
    return namespace[RUNTIME_NAME]
