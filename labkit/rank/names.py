"""A rank's own names, as the notebook sees them: completed (``lab.complete``) and listed (``lab.who``).

Runs inside a rank, over the engine's user namespace (the one a ``%%lab`` cell runs in). Both answer
fast and run no code of the user's objects beyond what IPython's own completer would:

- completion is IPython's completer over the namespace, without jedi, with IPython's "limited"
  evaluation (attributes are listed with ``dir``; a property or a custom ``__getattr__`` is never
  called to reach the object after it). One thing is added to what it may read: an ``nn.Module``'s
  submodules, parameters and buffers through torch's own ``Module.__getattr__`` (a dict lookup), so
  ``model.fc.<Tab>`` works; a subclass that overrides ``__getattr__`` is still refused;
- a variable is described from its class and, for tensors, arrays and modules, their shape, dtype,
  device, placement or parameter count; only numbers, strings and None are shown by value.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from labkit.wire.current import RUNTIME_NAME
from labkit.wire.schema import VariableInfo

# The names the lab puts into every rank's namespace (rank.runtime), left out of lab.who.
LAB_NAMES = frozenset({RUNTIME_NAME, "rank", "world_size", "device", "mesh", "torch", "dist", "exit", "quit"})
SCALARS = (int, float, complex, bool, str, bytes, type(None))
VALUE_WIDTH = 40  # a value's repr is cut to this many characters
# torch's own Module.__getattr__ only reads the module's dicts of submodules, parameters and buffers.
MODULE_GETATTR = ("torch", "nn", "Module")


def complete(shell: Any, namespace: dict, code: str, offset: int) -> list[tuple[int, int, str, str]]:
    """IPython's completions of ``code`` at ``offset`` over ``namespace``: (start, end, text, type) each.

    ``shell``: the engine's IPython shell (the completer asks it which magics exist). Magics are left
    out: a ``%%lab`` cell runs as plain Python on the ranks."""
    from IPython.core.completer import IPCompleter, provisionalcompleter
    from IPython.core.guarded_eval import EVALUATION_POLICIES

    allowed = set(getattr(EVALUATION_POLICIES.get("limited"), "allowed_getattr_external", set()))
    completer = IPCompleter(shell=shell, namespace=namespace, global_namespace=namespace, use_jedi=False,
                            policy_overrides={"allowed_getattr_external": allowed | {MODULE_GETATTR}})
    with provisionalcompleter():
        return [(found.start, found.end, found.text, found.type or "") for found in completer.completions(code, offset)
                if found.type != "magic"]


def user_variables(namespace: dict, hidden: dict) -> dict[str, Any]:
    """The user's names in ``namespace``: not the lab's (``LAB_NAMES``), not IPython's own (``hidden``, its
    ``user_ns_hidden``: In, Out, get_ipython, while they are still IPython's), no module, none starting with _."""
    absent = object()
    return {name: value for name, value in namespace.items()
            if not name.startswith("_") and name not in LAB_NAMES and hidden.get(name, absent) is not value
            and not isinstance(value, types.ModuleType)}


def describe_names(namespace: dict, hidden: dict) -> dict[str, VariableInfo]:
    """Every user variable of ``namespace`` (``user_variables``), described by ``describe_value``."""
    return {name: describe_value(value) for name, value in sorted(user_variables(namespace, hidden).items())}


def describe_value(value: object) -> VariableInfo:
    """What ``value`` is: its class, and what tells such things apart (see ``VariableInfo``).

    Whatever reading a detail raises leaves that detail out: the class is always there."""
    info: VariableInfo = {"type": type_name(value)}
    try:
        info.update(_details(value))
    except Exception:
        pass
    return info


def type_name(value: object) -> str:
    if isinstance(value, type):
        return "class"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return "function"
    return type(value).__name__


def _details(value: object) -> VariableInfo:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor_details(value)
    if torch is not None and isinstance(value, torch.nn.Module):
        return {"parameters": sum(parameter.numel() for parameter in value.parameters())}
    if isinstance(value, SCALARS):
        return {"value": short_repr(value)}
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return {"length": len(value)}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": "cpu"}
    return {}


def _tensor_details(tensor: Any) -> VariableInfo:
    details: VariableInfo = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "device": str(tensor.device)}
    distributed = sys.modules.get("torch.distributed.tensor")
    dtensor_class = getattr(distributed, "DTensor", None)
    if dtensor_class is not None and isinstance(tensor, dtensor_class):
        details["placement"] = placement_text([repr(placement) for placement in tensor.placements],
                                              tuple(tensor.device_mesh.shape), tensor.device_mesh.mesh_dim_names)
    return details


def placement_text(placements: list[str], mesh_shape: tuple[int, ...], axis_names: tuple[str, ...] | None) -> str:
    """``Shard(dim=0) over dp=2`` / ``Shard(dim=0), Replicate() over dp=2, tp=2`` / ``... over mesh (2,)``."""
    axes = ", ".join(f"{name}={size}" for name, size in zip(axis_names, mesh_shape)) if axis_names \
        else f"mesh {mesh_shape}"
    return f"{', '.join(placements)} over {axes}"


def short_repr(value: object) -> str:
    if isinstance(value, (str, bytes)) and len(value) > VALUE_WIDTH:
        value = value[:VALUE_WIDTH]  # the repr of a long string is never built whole
    text = repr(value)
    return text if len(text) <= VALUE_WIDTH else text[:VALUE_WIDTH - 3] + "..."
