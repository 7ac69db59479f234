"""What the notebook asks of a rank beyond its runtime's own methods: train, save, load, seed, push, names.

The functions the notebook sends (``labkit.wire.entry``) are importable on both
sides and know nothing of the rank's code: each reaches the rank's runtime
(``this_rank()``) and asks it, or asks this object (``runtime.requests``), which
imports the heavy modules here, on the rank, where torch is already loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.rank.runtime import RankRuntime
    from labkit.spec.link import LinkSpec
    from labkit.spec.train_config import TrainConfig


class RankRequests:
    """The rank side of ``wire.entry``'s functions that need more than the runtime."""

    def __init__(self, runtime: RankRuntime) -> None:
        self.runtime = runtime

    def leave_groups(self, reason: str) -> list[str]:
        from labkit.rank.stale_objects import distributed_variables

        runtime = self.runtime
        held = distributed_variables(runtime.namespace) if runtime.groups.handles else []
        runtime.leave_group(reason)
        return held

    def all_reduce_check(self) -> float:
        """One all-reduce of ones; the sum (== world size when the group works)."""
        import torch
        import torch.distributed as dist

        tensor = torch.ones(1, device=self.runtime.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def train_member(self, spec: dict) -> dict:
        from labkit.rank.ensemble import train_member

        return train_member(spec)

    def diloco_reference(self, config) -> tuple[bytes, bytes]:
        import torch

        from labkit.rank.own_model import trainable_for
        from labkit.rank.verify import resummed_chunks
        from labkit.strategies.diloco import reference_parameters

        trainable = trainable_for(config, self.runtime)
        flat = []
        # The reference, then the same mathematics summed in other orders: how far rounding alone moves it.
        for chunks in (1, resummed_chunks(config)):
            _, final = reference_parameters(config, "cpu", config.steps, chunks=chunks, trainable=trainable)
            flat.append(torch.cat([value.reshape(-1).float() for value in final.values()]).numpy().tobytes())
        return flat[0], flat[1]

    def seed(self, value: int, same: bool) -> int:
        from labkit.rank.environment import seed_as_asked

        self.runtime.seeding = (value, same)
        return seed_as_asked(self.runtime.seeding, self.runtime.rank)

    def set_link(self, spec: LinkSpec | None) -> str:
        from labkit.rank.instruments.slow_link import apply_link

        return apply_link(self.runtime, spec)

    def train(self, config: TrainConfig, timeout_seconds: float) -> dict:
        from labkit.rank.loop import train as train_loop

        return self.runtime.call(train_loop, (config,), {}, None, timeout_seconds)

    def model_state(self, timeout_seconds: float) -> dict:
        from labkit.rank.whole_model import whole_model

        return self.runtime.call(whole_model, (self.runtime,), {}, None, timeout_seconds)

    def training_position(self) -> dict | None:
        runtime = self.runtime
        state = runtime.train_state
        if state is None:
            return None
        return {"step": state.step, "updating": state.updating, "formation": state.formation,
                "current": state.formation == runtime.formation}

    def save_checkpoint(self, target: str, partial: str, meta: dict, timeout_seconds: float) -> dict:
        runtime = self.runtime

        def save() -> Any:
            from labkit.rank.checkpoint import save as save_state

            if runtime.train_state is None:
                raise RuntimeError("this rank has no training state to save (it was restarted since the run): "
                                   "train again, or load a checkpoint")
            return save_state(runtime.train_state, target, partial, meta)

        return runtime.call(save, (), {}, None, timeout_seconds)

    def checkpoint_mismatches(self, directory: str, shares: dict) -> list:
        from labkit.spec.checkpoint_sums import mismatches

        return mismatches(directory, shares.get(self.runtime.rank, {}))

    def load_checkpoint(self, config: TrainConfig, directory: str, step: int, same_world: bool,
                        timeout_seconds: float) -> dict:
        runtime = self.runtime

        def load() -> int:
            from labkit.rank.checkpoint import load as load_state
            from labkit.rank.state import build_state
            from labkit.torch_support.optimizers import make_optimizer

            runtime.train_state = None  # the old model's memory goes before the new one is built
            state = build_state(config, runtime, make_optimizer)
            load_state(state, directory, step, same_world)
            runtime.train_state = state
            return state.step

        return runtime.call(load, (), {}, None, timeout_seconds)

    def estimate_memory(self, config: TrainConfig) -> dict:
        from labkit.rank.loop import estimate_memory

        return estimate_memory(config)

    def push(self, items: list, sources: dict, timeout_seconds: float) -> dict:
        from labkit.rank.push import receive

        runtime = self.runtime
        return runtime.call(receive, (items, runtime.namespace), {}, sources, timeout_seconds)

    def complete_names(self, code: str, offset: int) -> list[tuple[int, int, str, str]]:
        from IPython import get_ipython

        from labkit.rank.names import complete

        return complete(get_ipython(), self.runtime.namespace, code, offset)

    def describe_names(self) -> dict:
        from IPython import get_ipython

        from labkit.rank.names import describe_names

        shell = get_ipython()
        return describe_names(self.runtime.namespace, shell.user_ns_hidden if shell is not None else {})
