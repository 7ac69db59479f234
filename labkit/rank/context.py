"""What the training loop needs from the process it runs in: identity, device, meshes, recorder, state.

``RankContext`` is shared by a lab's rank (``runtime.RankRuntime``, which adds
the process group, cells and scripts) and by a process that torchrun started
(``ScriptContext``), so the benchmarks run the very same loop both ways to
measure what the lab adds.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from labkit.rank.instruments.recorders import recorder_for
from labkit.rank.instruments.slow_link import LinkState, QuietRecorder
from labkit.rank.instruments.timed_group import instrument_mesh
from labkit.torch_support import torch_internals
from labkit.wire.gpus import gpu_index, gpus_shown

if TYPE_CHECKING:
    from labkit.rank.state import TrainState


class RankContext:
    """One process's rank, device, meshes (built once per process group) and training state."""

    def __init__(self, rank: int, backend: str, device: torch.device) -> None:
        self.rank = rank
        self.backend = backend
        self.device = device
        self.recorder = recorder_for(rank, device)
        self.link = LinkState()  # the simulated slow link (lab.link), off until the notebook sets one
        self.store: dist.Store | None = None  # the process group's rendezvous store, where the notebook's requests wait
        self.generation = 0
        self.formation = 0  # the generation the world was last formed in (a rebuild in place keeps it)
        self.meshes: dict[tuple[Any, ...], Any] = {}  # (shape, names, instrumented) -> DeviceMesh of this group
        self.train_state: TrainState | None = None  # the last run's, until the group changes
        # The user's own model, data and loss last built from what the notebook sent: (fingerprint, parts).
        self.own_built: tuple[str, dict] | None = None
        self.loop_watch = None  # the instruments on user code while it runs watched (``instruments.loop_watch``)

    def mesh_for(self, shape, names, instrumented: bool = True):
        """A device mesh of this shape, built once per process group (building one creates groups).

        Instrumented meshes report every collective over their groups to the
        rank's recorder; plain ones exist to measure what that costs. Both cross
        the simulated link when one is set (``slow_link``).
        """
        key = (tuple(shape), tuple(names), instrumented)
        if key not in self.meshes:
            from torch.distributed.device_mesh import init_device_mesh

            # Naming the backend makes a dimension over every rank a group of its own instead of the
            # default group: the lab's own traffic on the default group is then no step's, and measuring
            # the mesh leaves what cells send on the default group alone.
            backend = dist.get_backend()
            mesh = init_device_mesh(self.device.type, key[0], mesh_dim_names=key[1],
                                    backend_override={name: backend for name in key[1]})
            groups = getattr(self, "groups", None)  # a lab rank's (rank.lab_groups); a script has none
            if groups is not None and not torch_internals.routes_new_groups():
                groups.adopt_mesh(mesh)
            if instrumented:
                instrument_mesh(mesh, self.recorder, self.link)
            elif self.link.active:  # no instruments, but the link must still slow the run's collectives
                instrument_mesh(mesh, QuietRecorder(), self.link)
            self.meshes[key] = mesh
        return self.meshes[key]

    def forget_group(self) -> None:
        """The process group is going: its meshes and the training state built on them go too."""
        self.meshes.clear()
        self.train_state = None


class ScriptContext(RankContext):
    """A process started by torchrun, with its process group already initialised."""

    def __init__(self) -> None:
        backend = "nccl" if "nccl" in dist.get_backend() else "gloo"
        if backend == "nccl":
            device = torch.device("cuda", script_gpu(os.environ))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        super().__init__(dist.get_rank(), backend, device)


def script_gpu(environ) -> int:
    """The CUDA device index of a torchrun-started process whose environment is ``environ``: the lab
    rank's own rule on LOCAL_RANK, so a script under torchrun and the same script in a lab agree (one
    GPU shown by CUDA_VISIBLE_DEVICES is cuda:0 whatever LOCAL_RANK says)."""
    return gpu_index(int(environ.get("LOCAL_RANK", "0")), gpus_shown(environ))
