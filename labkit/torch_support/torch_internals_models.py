"""torch's private API for the state of models: DDP's reducer, FSDP2's iteration and its mesh.

Runs in the engines; the companion of ``torch_internals`` (which lists these in ``missing_internals``), kept
apart only for its length. ``rank.model_steps`` reads and resets this state after a failed cell: it watches
each DistributedDataParallel forward begin, reads what the reducer shows of its iterations, forgets an
unfinished reduction or a pending bucket rebuild, gives a model the reducer it was built with, and resets
FSDP2's iteration (torch's ``reset_iter_state``) with the gradients a cut backward left behind. The watch
on a loop the lab did not write reads the mesh a ``fully_shard`` module shards over, for which torch offers no
public call (``data_parallel_size``), to count a replica's batch once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def model_internals() -> dict[str, Callable[[], object]]:
    """The private names used here, each with a look-up that raises AttributeError where torch lacks it."""
    from torch.nn.parallel import DistributedDataParallel

    reducer = getattr(torch._C._distributed_c10d, "Reducer", None)  # looked up in it below, one name at a time
    return {
        **{f"nn.parallel.DistributedDataParallel.reducer.{name}": _look_up(reducer, name)
           for name in ("_reset_state", "get_backward_stats", "_remove_autograd_hooks",
                        "_set_mixed_precision_param_dtype")},
        **{f"nn.parallel.DistributedDataParallel.{name}": _look_up(DistributedDataParallel, name)
           for name in ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper",
                        "_set_static_graph", "_check_reducer_finalized")},
        "distributed._register_comm_hook": lambda: dist._register_comm_hook,
        "distributed.fsdp.FSDPModule._get_fsdp_state": _fsdp_state_look_up,
    }


def _fsdp_state_look_up() -> object:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule._get_fsdp_state


def _look_up(owner, name: str) -> Callable[[], object]:
    return lambda: getattr(owner, name)


def watch_ddp_forwards(before_forward: Callable) -> None:
    """Call ``before_forward(module)`` as every DistributedDataParallel's forward begins, in this process.

    torch offers no hook for it that costs nothing elsewhere (a global forward hook slows every module):
    DistributedDataParallel's own ``forward`` is wrapped once; a later call only changes the callback."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel.forward
    if getattr(wrapped, "labkit_before_forward", None) is not None:
        wrapped.labkit_before_forward = before_forward  # type: ignore[attr-defined]
        return
    original = wrapped

    def forward(self, *inputs, **kwargs):
        if not torch.compiler.is_compiling():
            forward.labkit_before_forward(self)
        return original(self, *inputs, **kwargs)

    forward.labkit_before_forward = before_forward  # type: ignore[attr-defined]
    forward.__doc__, forward.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
    DistributedDataParallel.forward = forward  # type: ignore[method-assign]


def ddp_has_own_reducer(module) -> bool:
    """Whether a DistributedDataParallel reduces through a reducer of its own (not the python reducer of
    compiled autograd, nor hooks that replace it): the state the functions below read and reset."""
    return not (getattr(module, "_use_python_reducer", False) or getattr(module, "_delay_all_reduce_all_params", False))


def ddp_iteration_state(module) -> tuple[bool, tuple[int, ...]]:
    """What a DistributedDataParallel's reducer shows of its iterations: whether its buckets were rebuilt in
    the order gradients arrive, and when each parameter's gradient was last marked ready."""
    return bool(module._has_rebuilt_buckets), tuple(module.reducer.get_backward_stats())


def ddp_reducer_settled(module) -> bool:
    """False while a DistributedDataParallel's backward has marked gradients ready and not finished."""
    try:
        module._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


def reset_ddp_reducer(module) -> None:
    """Forget a DistributedDataParallel's unfinished reduction and its pending bucket rebuild: its buckets are
    rebuilt again after its next backward, in the order its gradients arrive (the layout they have)."""
    module.reducer._reset_state()
    module._has_rebuilt_buckets = False


def fsdp_roots(objects) -> list:
    """The FSDP2 models among ``objects`` that ran a forward as the root of their model (torch decides the
    root at the first forward): the modules whose per-iteration state ``reset_fsdp_iteration`` resets."""
    from torch.distributed.fsdp import FSDPModule

    roots = []
    for candidate in objects:
        if isinstance(candidate, FSDPModule):
            state = candidate._get_fsdp_state()
            if state._is_root:
                roots.append(candidate)
    return roots


def reset_fsdp_iteration(root) -> bool:
    """Put an FSDP2 model's per-iteration state (training states, pending reduce-scatters, the forward root,
    unsharded parameters) as before an iteration began, discarding a failed iteration's gradients in flight;
    False where this torch offers no way to (it lacks ``FSDPModule.reset_iter_state``)."""
    reset = getattr(root, "reset_iter_state", None)
    if reset is None:
        return False
    reset()
    # torch's reset leaves the gradients a cut backward computed into the unsharded parameters, whose
    # reduce-scatter never ran: the next backward would add to them on the ranks that got that far.
    for state in root._get_fsdp_state()._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            for parameter in group.fsdp_params:
                parameter.unsharded_accumulated_grad = None
                if hasattr(parameter, "_unsharded_param"):
                    parameter._unsharded_param.grad = None
    return True


def fresh_ddp_reducer(module) -> None:
    """Give a DistributedDataParallel that has not finished an iteration the reducer it was built with:
    no iteration counted, first-iteration bookkeeping (static graph's) undone, buckets as at construction.

    Collective-free (the parameters were synchronized when it was built). Its communication hooks
    registered through ``register_comm_hook`` and its mixed precision are set again."""
    old = module.reducer
    old._remove_autograd_hooks()
    parameters, expect_sparse_gradient = module._build_params_for_reducer()
    names = module._build_debug_param_to_name_mapping(parameters)
    static_graph = bool(module.static_graph)
    module._ddp_init_helper(parameters, expect_sparse_gradient, names, static_graph)
    for hook, state in getattr(module, "_comm_hooks", []):
        dist._register_comm_hook(module.reducer, state, hook)
    if getattr(module, "mixed_precision", None) is not None:
        module.reducer._set_mixed_precision_param_dtype(module.mixed_precision.param_dtype)
    module._has_rebuilt_buckets = False
    if static_graph:
        module.static_graph = False  # torch's _set_static_graph sets it up once
        module._set_static_graph()


def data_parallel_size(module) -> int | None:
    """Over how many ranks a data-parallel module (DDP, FSDP, ``fully_shard``) splits its data: the size of
    the group (or the FSDP2 mesh, all of its dimensions) it averages gradients over; None when unknown."""
    group = getattr(module, "process_group", None)  # DDP and FSDP1 keep theirs, public
    if group is not None:
        return group.size()
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 keeps its mesh in each module's parameter groups (a list of them, or one, by torch release); a
    # root that holds no parameter of its own has none, so the first sharded module's is taken.
    for part in module.modules():
        if not isinstance(part, FSDPModule):
            continue
        state = part._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for param_group in groups:
            return param_group.mesh_info.mesh.size()
    return None
