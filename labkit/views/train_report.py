"""What a training run tells the notebook: loss, speed, memory per rank, equivalence.

Built from every rank's result dict (see ``train.train``); pure, no torch. The
loss of a step is the mean over data-parallel replicas of the loss each replica
computed on its slice (only the last pipeline stage computes it; tensor-parallel
ranks of a replica compute the same value). A step takes as long as its slowest
rank.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass

from labkit.spec.device_peaks import math_kind, peak_tflops
from labkit.spec.train_config import TrainConfig
from labkit.units import format_bytes
from labkit.views.metrics import StepNumber
from labkit.views.nonfinite_report import agreed_steps, seen_steps, stop_line, summary_line
from labkit.wire.schema import EQUIVALENCE_TOLERANCE, NOISE_FACTOR, MemoryBytes, NonFiniteStep, RankResult, StepRow, \
    TimelineStep, Verdict, equivalence_bound
from labkit.wire.schema import total_bytes as _total
from labkit.zoo.catalog import model


def bytes_per_step(rows_per_rank) -> dict[str, int]:
    """Bytes through collectives in one step, by kind: each rank's mean over its rows, summed over ranks."""
    total: dict[str, float] = {}
    for rows in rows_per_rank:
        for row in rows:
            for kind, size in row["bytes"].items():
                total[kind] = total.get(kind, 0.0) + size / len(rows)
    return {kind: int(round(size)) for kind, size in sorted(total.items())}


@dataclass
class TrainReport:
    config: TrainConfig
    results: list[RankResult]  # one per rank, in rank order
    notes: tuple[str, ...] = ()  # what happened on the way (failures healed)

    # -- derived numbers ------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Steps every rank completed (fewer than asked if the run was stopped)."""
        return min(r["steps_done"] for r in self.results)

    @property
    def stopped_early(self) -> bool:
        return self.steps_done < self.config.steps

    @property
    def losses(self) -> list[float]:
        """Per step: the mean over dp replicas of each replica's loss."""
        owners = [
            losses for r in self.results
            if r["owns_loss"] and r["coordinate"].get("tp", 0) == 0 and (losses := r["losses"]) is not None
        ]
        return [statistics.fmean(losses[step] for losses in owners) for step in range(self.steps_done)]

    @property
    def stopped_at_nonfinite(self) -> NonFiniteStep | None:
        """The step whose loss was not finite, where the run stopped (``on_nonfinite='stop'``); None if it did not."""
        agreed = agreed_steps(self.results)
        return agreed[-1] if agreed and self.config.on_nonfinite == "stop" else None

    @property
    def stop_line(self) -> str | None:
        """The one line that says why the run stopped at a loss that was not finite (None: it did not)."""
        step = self.stopped_at_nonfinite
        if step is None:
            return None
        losses = self.losses
        return stop_line(step, losses[-1] if losses else None, self.config.first_step + self.steps_done)

    @property
    def nonfinite_line(self) -> str | None:
        """What the report says of steps whose loss was not finite and that did not stop the run."""
        agreed = agreed_steps(self.results)
        if self.stopped_at_nonfinite is not None:
            return None
        steps = agreed or seen_steps(self.results, self.config.first_step)
        return summary_line(steps, self.config.on_nonfinite, bool(agreed))

    @property
    def step_seconds(self) -> list[float]:
        """Per step: the slowest rank's time."""
        return [max(r["step_seconds"][step] for r in self.results) for step in range(self.steps_done)]

    @property
    def median_step_seconds(self) -> float:
        """Median over steps, leaving out the first (it warms up)."""
        times = self.step_seconds
        return statistics.median(times[1:] or times)

    def _steady_rows(self, result: RankResult) -> list[StepRow]:
        rows: list[StepRow] = result.get("rows") or []
        return rows[1:] or rows

    @property
    def comm_bytes_per_step(self) -> dict[str, int]:
        """Bytes through collectives in one step, by kind, summed over ranks (mean over steps)."""
        return bytes_per_step(self._steady_rows(result) for result in self.results)

    def per_rank_means(self, field: StepNumber) -> list[float]:
        """Mean of a row field (compute, exposed_comm, seconds) per rank, over steady steps."""
        means = []
        for result in self.results:
            rows = self._steady_rows(result)
            means.append(statistics.fmean(row[field] for row in rows) if rows else 0.0)
        return means

    @property
    def comm_bytes_per_rank(self) -> float:
        """Mean over ranks of the bytes each moved through collectives in one step."""
        return sum(self.comm_bytes_per_step.values()) / len(self.results)

    @property
    def samples_per_second(self) -> float:
        return self.config.global_batch / self.median_step_seconds

    @property
    def tokens_per_second(self) -> float | None:
        own = self.config.own
        if own is not None:
            count = own.tokens_per_sample
        else:
            counter = model(self.config.model).tokens_per_sample
            count = counter(self.config.model_config) if counter is not None else None
        if count is None:
            return None  # not a language model: its samples are not counted in tokens
        return self.samples_per_second * count

    @property
    def device_name(self) -> str:
        return self.results[0].get("device_name", "cpu")

    @property
    def model_flops_per_step(self) -> int:
        """The model's training FLOPs for one step's global batch, however it is split."""
        return self.config.training_flops_per_sample() * self.config.global_batch

    @property
    def achieved_tflops(self) -> float:
        """Model FLOPs per second over all ranks, in TFLOP/s."""
        return self.model_flops_per_step / self.median_step_seconds / 1e12

    @property
    def peak_tflops(self) -> float | None:
        """Peak of one device for this run's math: given, or from the data sheet; None when unknown."""
        if self.config.peak_tflops is not None:
            return float(self.config.peak_tflops)
        if self.device_name == "cpu":
            return None
        return peak_tflops(self.device_name, self.config.precision, self.config.tf32)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved model FLOPs over the peak of all the run's devices."""
        peak = self.peak_tflops
        return None if peak is None else self.achieved_tflops / (peak * len(self.results))

    @property
    def memory(self) -> list[MemoryBytes]:
        return [r["memory"] for r in self.results]

    @property
    def max_memory_bytes(self) -> int:
        return max(_total(memory) for memory in self.memory)

    @property
    def strategy_results(self) -> list[dict]:
        """Per rank, in rank order: what its strategy measured (a parameter server's staleness per update)."""
        return [r.get("strategy_results") or {} for r in self.results]

    @property
    def verify(self) -> Verdict | None:
        return self.results[0].get("verify")

    @property
    def max_relative_difference(self) -> float | None:
        verify = self.verify
        return None if verify is None else verify["max_relative_difference"]

    @property
    def equivalence_bound(self) -> float | None:
        """The largest difference that is still rounding: max(1e-5, 10 x the run's rounding noise)."""
        verify = self.verify
        return None if verify is None else equivalence_bound(verify.get("rounding_noise", 0.0))

    @property
    def equivalent(self) -> bool | None:
        difference, bound = self.max_relative_difference, self.equivalence_bound
        if difference is None or bound is None:
            return None
        return difference < bound and not self.nonfinite_verdict

    @property
    def nonfinite_verdict(self) -> str:
        """Which side of the comparison holds NaN or infinity, in words ("": neither); the counts are the most
        parameters on any one rank."""
        verify = self.verify
        if verify is None:
            return ""
        run, reference = verify.get("nonfinite_run", 0), verify.get("nonfinite_reference", 0)
        if not run and not reference:
            return ""
        first = verify.get("nonfinite_parameter_here") or ""
        run_side = (f"{run} of this run's parameters hold NaN or infinity" if run
                    else "this run's parameters are all finite")
        reference_side = (f"{reference} of the single-process reference's hold NaN or infinity" if reference
                          else "the single-process reference's are all finite")
        return f"{run_side}; {reference_side}" + (f" (rank 0's first: {first})" if first else "")

    def timeline(self, steps: int | None = 4):
        """A Gantt picture of the last ``steps`` steps on every rank (``export_trace`` for Perfetto)."""
        from labkit.views.timeline import Timeline

        entries: dict[int, list[TimelineStep]] = {result["rank"]: result["timeline"] for result in self.results}
        if not all(entries.values()):
            raise ValueError("this run kept no timeline (it ran with instruments=False)")
        return Timeline(entries, steps, title=timeline_title(self.config, entries, steps))

    def export_trace(self, path: str, steps: int | None = None) -> str:
        """Write a Chrome/Perfetto trace of the last steps (all that were kept by default)."""
        return self.timeline(steps).export_trace(path)

    # -- pictures ---------------------------------------------------------------

    def _memory_rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for result in self.results:
            memory = result["memory"]
            where = " ".join(f"{name}={index}" for name, index in result["coordinate"].items())
            rows.append(
                (
                    str(result["rank"]),
                    where,
                    format_bytes(memory["params"]),
                    format_bytes(memory["grads"]),
                    format_bytes(memory["optimizer"]),
                    format_bytes(_total(memory)),
                )
            )
        return rows

    def summary_lines(self) -> list[str]:
        config, losses = self.config, self.losses
        rate = f"{self.samples_per_second:,.0f} samples/s"
        if self.tokens_per_second is not None:
            rate += f" ({self.tokens_per_second:,.0f} tokens/s)"
        total = sum(self.comm_bytes_per_step.values()) or 1
        kinds = ", ".join(  # kinds under 0.1% of the traffic (DDP's one-off bucket rebuild, say) are left out
            f"{kind} {format_bytes(size / len(self.results))}" for kind, size in self.comm_bytes_per_step.items()
            if size >= total / 1000
        )
        stopped = f" (stopped after {self.steps_done})" if self.stopped_early else ""
        if config.first_step:
            stopped += f", continuing the last run from step {config.first_step}"
        lines = [
            f"{config.describe()}: {config.steps} steps{stopped}, global batch {config.global_batch}",
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
            f"step time {self.median_step_seconds * 1000:.1f} ms (median, slowest rank), {rate}",
            f"communication per rank and step: {format_bytes(self.comm_bytes_per_rank)}" + (f" ({kinds})" if kinds else ""),
        ]
        if self.device_name != "cpu" or config.peak_tflops is not None:
            math = math_kind(config.precision, config.tf32)
            flops = f"model FLOPs {self.achieved_tflops:,.1f} TFLOP/s on {len(self.results)} x {self.device_name}"
            if self.mfu is None:
                flops += f"; MFU unknown: no {math} peak known for this device (give peak_tflops=...)"
            else:
                flops += f", MFU {self.mfu:.1%} of the {math} peak ({self.peak_tflops:g} TFLOP/s each)"
            if config.own is not None and config.own.attention is None:  # 6 per parameter and token, no more
                flops += (" (a parameter-only estimate: attention and weight reuse in convolutions are not counted; "
                          "attention=dict(layers=..., dim=...) counts a transformer's attention)")
            lines.append(flops)
        if config.max_memory:
            verdict = "within" if self.max_memory_bytes <= config.max_memory else "OVER"
            lines.append(
                f"memory budget {format_bytes(config.max_memory)} per rank: largest rank uses "
                f"{format_bytes(self.max_memory_bytes)} ({verdict})"
            )
        if self.verify is not None and self.nonfinite_verdict:
            lines.append(f"against single-process training: NOT compared, no difference can be measured: "
                         f"{self.nonfinite_verdict}")
        elif self.verify is not None:
            verdict = "equal" if self.equivalent else "NOT equal"
            noise = self.verify.get("rounding_noise", 0.0)
            lines.append(
                f"against single-process training: largest relative difference of a parameter "
                f"{self.max_relative_difference:.1e} ({verdict} within max({EQUIVALENCE_TOLERANCE:g}, "
                f"{NOISE_FACTOR:g} x the rounding noise {noise:.1e}); "
                f"training moved the model {self.verify['model_moved']:.1%} from its start)"
            )
        lines.extend(f"rank {r['rank']} ({r.get('role', 'trainer')}): {r['strategy_results']['summary']}"
                     for r in self.results if (r.get("strategy_results") or {}).get("summary"))
        if self.nonfinite_line is not None:
            lines.append(self.nonfinite_line)
        lines.extend(f"healed: {note}" for note in self.notes)
        return lines

    def __str__(self) -> str:
        header = ("rank", "mesh", "params", "grads", "optimizer", "total")
        rows = self._memory_rows()
        widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
        table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
        return "\n".join([*self.summary_lines(), "memory per rank:", *table])

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{cell}</th>" for cell in ("rank", "mesh", "params", "grads", "optimizer", "total"))
        body = "".join(
            "<tr>" + "".join(f"<td style='padding:2px 8px'>{html.escape(cell)}</td>" for cell in row) + "</tr>"
            for row in self._memory_rows()
        )
        lines = "".join(f"<div>{html.escape(line)}</div>" for line in self.summary_lines())
        return f"<div>{lines}<div>memory per rank:</div><table><tr>{head}</tr>{body}</table></div>"


def timeline_title(config: TrainConfig, entries_by_rank: dict[int, list[TimelineStep]], steps: int | None) -> str:
    """A timeline's title: the run, its pipeline schedule (what tells two pipeline timelines apart)
    and which steps are shown, counted as they are ("last step", "last 3 steps")."""
    shown = set.intersection(*(set(entry["step"] for entry in entries) for entries in entries_by_rank.values()))
    count = min(len(shown), steps) if steps else len(shown)
    schedule = config.options.get("schedule") if "pp" in config.mesh.names else None
    how = f", {SCHEDULE_NAMES.get(schedule, schedule)} schedule, {config.micro_batches} microbatches" if schedule else ""
    which = "last step" if count == 1 else f"last {count} steps"
    return f"{config.describe()}{how}: {which}"


SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}
