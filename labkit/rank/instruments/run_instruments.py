"""What a training run measures, or nothing: the loop calls the same methods either way.

With instruments on (``RunInstruments``), a run:

- makes one row per step in the rank's recorder (``recorder`` / ``gpu_recorder``),
  with the model's waits bracketed (``backward_watch``, FSDP's pre-forward waits);
- publishes the newest rows to the notebook a few times a second (``Publisher``);
- reads the notebook's requests between steps (``control.ControlChannel``): a
  slowdown is spent inside the step, and a stop is agreed by all ranks every
  ``STOP_CHECK_EVERY`` steps (one 4-byte all-reduce), so that all stop at the
  same step boundary and none is left waiting in a collective.

With them off (``NoInstruments``) every one of these does nothing, so the loop
reads top to bottom without asking at each step whether instruments are on.
"""

from __future__ import annotations

import torch.distributed as dist

from labkit.rank.control import ControlChannel
from labkit.rank.lab_traffic import control_tensor
from labkit.rank.instruments.recorder import Publisher

STOP_CHECK_EVERY = 4  # steps between agreements on a stop request


def _agree_to_stop(requested: bool) -> bool:
    """All ranks stop at the same step boundary, or none would be left waiting in a collective."""
    flag = control_tensor([1.0 if requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class RunInstruments:
    """A run's rows, their publishing to the notebook, and the notebook's stop and slowdown requests."""

    def __init__(self, runtime, parallel) -> None:
        self.recorder = runtime.recorder
        parallel.backward_watch = self.recorder.backward_watch
        self.recorder.watch_module_waits(parallel.module)
        self.publisher = Publisher(self.recorder)
        device = runtime.device  # a GPU spends a slowdown in its stream, with the rank's calibrated delay
        delay = runtime.link.stream_delay(device) if device.type == "cuda" else None
        self.control = ControlChannel(runtime.store, runtime.rank, stream_delay=delay)

    def stop_agreed(self, step: int) -> bool:
        """Read the requests; every ``STOP_CHECK_EVERY`` steps, whether all ranks agree to stop here."""
        self.control.poll()
        return bool(step) and step % STOP_CHECK_EVERY == 0 and _agree_to_stop(self.control.stop_requested)

    def begin_step(self, step: int) -> float:
        """The step begins (rows count steps from the run's start); spend an injected slowdown; its seconds."""
        self.recorder.begin_step(step)
        return self.control.spend_delay()

    def end_step(self, samples: float, tokens: float | None, loss, delay: float) -> None:
        self.recorder.end_step(samples, tokens, loss, delay)
        self.publisher.maybe_publish()

    def finish(self) -> None:
        """Every pending row read (a GPU's, once the device has passed it) and the last ones published."""
        self.recorder.finish()
        self.publisher.maybe_publish(force=True)

    def rows(self) -> list:
        return list(self.recorder.rows)

    def timeline(self) -> list:
        return list(self.recorder.timeline)


class NoInstruments:
    """A run without instruments: nothing measured, published or read from the notebook."""

    def stop_agreed(self, step: int) -> bool:
        return False

    def begin_step(self, step: int) -> float:
        return 0.0

    def end_step(self, samples: float, tokens: float | None, loss, delay: float) -> None:
        """Nothing is kept."""

    def finish(self) -> None:
        """Nothing is pending."""

    def rows(self) -> list:
        return []

    def timeline(self) -> list:
        return []


def instruments_for(config, runtime, parallel):
    """The run's instruments: ``RunInstruments`` when ``config.instruments``, else ``NoInstruments``."""
    return RunInstruments(runtime, parallel) if config.instruments else NoInstruments()
