"""DiLoCo fused across sites: ``lab.train("diloco", ..., sites=...)``, one model from machines that cannot reach
each other.

Each site trains as one replica (ddp, or fsdp with ``inner="fsdp"``, over its own ranks), on the shares
of the data the hub hands out (``runs.outer_hub``); every ``inner_steps`` its pseudo-gradient crosses its
line to the hub, which averages what came, takes the outer Nesterov step and sends the update back
(``strategies.diloco_sites``). Nothing of torch.distributed crosses a line.

``SitesRun`` starts a site's run (a ``TrainingRun`` in the background on the site's session) for every
site, and watches them: a site whose ranks fail is declared lost to the hub at once (its round closes
without it, its share goes back to the queue); when the site can work again (its agent's fresh engines,
or its join command run again), its run starts anew, pulls the hub's weights and comes in at the next
round. The run ends when every share was trained once. ``verify`` (float32 on the wire, every site in
every round) simulates the same DiLoCo in one process on a rank and compares the weights.
"""

from __future__ import annotations

import math
import secrets
import statistics
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import numpy

from labkit.cluster.site_cluster import registered_engines
from labkit.line.targets import SYNC
from labkit.runs.launch import resolve_run
from labkit.runs.outer_hub import OuterHub, RoundRecord
from labkit.runs.training_run import TrainingRun
from labkit.spec.errors import LabConfigError, LabError
from labkit.strategies.diloco import INNER_STEPS
from labkit.units import format_bytes
from labkit.views.sites_report import SitesReport, largest_relative_difference
from labkit.wire import entry

if TYPE_CHECKING:
    from labkit.session import Session

WIRES = ("bf16", "fp32")
INNERS = ("ddp", "fsdp")
POLL_SECONDS = 0.2
START_SECONDS = 120.0  # the first round waits this long for every site to say hello


def check_request(strategy: str, inner: str, wire: str, quorum, round_timeout, settings: dict,
                  sites: dict[str, Session]) -> None:
    if not sites:
        raise LabConfigError("sites= names no site: run lab.join_command(https=True)'s line on each machine first")
    if strategy not in ("diloco", "diloco+ddp", "diloco+fsdp"):
        raise LabConfigError(f"across sites the strategy is DiLoCo (each site one replica), got {strategy!r}: "
                             "lab.train('diloco', ..., sites=...)")
    if inner not in INNERS or wire not in WIRES:
        raise LabConfigError(f"inner is {' or '.join(INNERS)} (inside each site) and wire is {' or '.join(WIRES)}; "
                             f"got inner={inner!r}, wire={wire!r}")
    if quorum is not None and (isinstance(quorum, bool) or not isinstance(quorum, int)
                               or not 1 <= quorum <= len(sites)):
        raise LabConfigError(f"quorum is how many sites a round needs after round_timeout, 1 to {len(sites)}; "
                             f"got {quorum!r}")
    if isinstance(round_timeout, bool) or not isinstance(round_timeout, (int, float)) or not round_timeout > 0:
        raise LabConfigError(f"round_timeout is seconds above 0, got {round_timeout!r}")
    for name in ("checkpoint_every", "resume", "auto_heal"):
        if settings.get(name):
            raise LabConfigError(f"{name} is not for a run across sites: the hub holds its state")
    if settings.get("verify") and (wire != "fp32" or inner != "ddp"):
        raise LabConfigError("verify across sites compares float32 weights of ddp sites: pass wire='fp32' (and "
                             "inner='ddp')")
    sizes = {name: session.world_size for name, session in sites.items()}
    if inner == "fsdp" and len(set(sizes.values())) > 1:
        raise LabConfigError(f"inner='fsdp' shards the model alike on every site, so each needs as many ranks: "
                             f"{sizes}; use inner='ddp'")


class SitesRun:
    """One DiLoCo run across sites: the hub's rounds and each site's part, watched from the notebook.

    ``lab.train("diloco", ..., sites=..., background=True)`` returns it started: ``progress()`` (rounds so
    far, shares queued), ``wait()`` (the ``SitesReport``), ``stop()`` (no new share: each site ends after
    its round), ``lines`` (what it said). In the foreground ``lab.train`` returns its report."""

    def __init__(self, lab: Session, hub, sites: dict[str, Session], settings: dict, timeout: float,
                 inner: str = "ddp", wire: str = "bf16", quorum: int | None = None,
                 round_timeout: float = 120.0, reopen: Callable[[str], Session] | None = None) -> None:
        strategy = settings.pop("strategy", None) or "diloco"
        check_request(strategy, inner, wire, quorum, round_timeout, settings, sites)
        self.lab, self.hub, self.sessions, self.timeout = lab, hub, dict(sorted(sites.items())), timeout
        self.reopen = reopen  # a site's session again (a new one if it joined anew): the lab's registry
        self.verify = bool(settings.pop("verify", False))
        self.replicas = len(sites)
        self.settings, self.inner = dict(settings), inner
        self.configs = {name: self._site_config(name, session, settings, inner) for name, session in self.sessions.items()}
        first = next(iter(self.configs.values()))
        self.inner_steps = first.setting(INNER_STEPS)
        if self.steps % self.inner_steps:
            raise LabConfigError(f"across sites every round is {self.inner_steps} inner steps (inner_steps): give "
                                 f"steps as a multiple of it, e.g. {math.ceil(self.steps / self.inner_steps) * self.inner_steps}")
        self.blocks = self.steps // self.inner_steps
        self.key, self.run_id = secrets.token_hex(16), secrets.token_hex(6)
        self.outer = OuterHub(self.run_id, self.key, list(self.sessions), self.replicas, self.blocks,
                              float(first.setting("outer_lr")), float(first.setting("outer_momentum")), wire,
                              quorum or max(1, self.replicas // 2 + 1), float(round_timeout), START_SECONDS)
        self.wire = wire
        self.runs: dict[str, TrainingRun] = {}
        self.reports: dict[str, list] = {name: [] for name in self.sessions}
        self.events: list[str] = []
        self.quiet = False
        self.lines: list[str] = []  # what it said (kept, in the background)
        self._thread: threading.Thread | None = None
        self.report: SitesReport | None = None
        self.error: BaseException | None = None
        self.lost: set[str] = set()  # sites whose run failed, until they come back
        self.finished: set[str] = set()  # sites whose run ended: the hub had no share left for them

    def _site_config(self, name: str, session: Session, settings: dict, inner: str):
        ranks = session.world_size
        strategy, mesh = ("diloco", {"replica": 1}) if ranks == 1 else (f"diloco+{inner}", {"replica": 1, "dp": ranks})
        global_batch = settings.get("global_batch") or 32
        if global_batch % (self.replicas * ranks):
            raise LabConfigError(f"global_batch {global_batch} does not split into {self.replicas} sites' slices of "
                                 f"{ranks} rank(s) at site {name!r}: give a multiple of {self.replicas * ranks}")
        config = resolve_run(session, {**settings, "strategy": strategy, "global_batch": global_batch}, mesh)
        self.steps = config.steps
        hub = {"run": "", "key": "", "site": name, "inner_steps": config.setting(INNER_STEPS), "wire": "",
               "replicas": self.replicas, "timeout": self.timeout}
        # Steps are an upper bound (a site may end up training every share); the hub ends the run sooner.
        bound = config.steps * self.replicas
        return replace(config, steps=bound, log_every=bound, outer_hub=hub)

    # -- running -----------------------------------------------------------------------

    def start_background(self) -> SitesRun:
        """Run in a thread of its own (its round lines are kept, not printed): ``wait()`` gives the report."""
        self.quiet = True
        self._thread = threading.Thread(target=self._run_kept, name="labkit-sites-run", daemon=True)
        self._thread.start()
        return self

    def _run_kept(self) -> None:
        try:
            self.report = self.run()
        except BaseException as error:  # noqa: BLE001 - handed to wait()
            self.error = error

    @property
    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SitesReport:
        if self._thread is None:
            raise LabError("this run across sites was not started in the background")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run across sites is still going after {timeout:g} s")
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report

    def progress(self) -> dict:
        """The hub's rounds so far, the shares queued, the sites in the open round."""
        return self.outer.progress()

    def stop(self) -> None:
        """No new share for any site: each ends after the round it is in (the hub's weights are the result)."""
        self.hub.call(_on_loop(self.outer.queue.clear))

    def run(self) -> SitesReport:
        began = time.monotonic()
        port = self.hub.call(self.outer.start())
        self.hub.add_target(SYNC, ("127.0.0.1", port))
        self._say(f"labkit: DiLoCo across {self.replicas} sites ({', '.join(self.sessions)}): {self.blocks * self.replicas}"
              f" shares of {self.inner_steps} steps, {self.wire} on the wire")
        try:
            for name in self.sessions:
                self._start(name)
            self._watch(began + self.timeout)
        finally:
            for run in self.runs.values():
                if not run.done:
                    run.stop()
            self.hub.call(self.outer.close())
        report = self._report(time.monotonic() - began)
        if self.verify:
            report.verify_difference, report.verify_noise = self._verify(report)
        return report

    def _start(self, name: str) -> None:
        session = self.sessions[name]
        if session.world_size != self.configs[name].axis("dp"):  # it came back with another number of ranks
            self.configs[name] = self._site_config(name, session, self.settings, self.inner)
        config = self.configs[name]
        hub = {**config.outer_hub, "run": self.run_id, "key": self.key, "wire": self.wire}
        config = replace(config, outer_hub=hub)
        session.ready()
        run = TrainingRun(session, config, self.timeout, dashboard=False, background=True)
        session.claim(run)
        try:
            self.runs[name] = run.start()
        except BaseException:
            session.release(run)
            raise

    def _watch(self, deadline: float) -> None:
        shown = 0
        while True:
            progress = self.outer.progress()
            for record in progress["rounds"][shown:]:
                self._say_round(record)
            shown = len(progress["rounds"])
            for name, run in self.runs.items():
                if name in self.lost or name in self.finished:
                    continue
                if run.done:
                    self._ended(name, run)
                elif (why := self._trouble(name)) is not None:
                    self._lose(name, why)  # before its run has failed: the round need not wait for that
            self._bring_back()
            if progress["finished"] and all(run.done for run in self.runs.values()):
                return
            if time.monotonic() > deadline:
                raise LabError(f"the run across sites did not finish within {self.timeout:g} s (timeout): "
                               f"{progress['queued']} shares were left")
            time.sleep(POLL_SECONDS)

    def _ended(self, name: str, run: TrainingRun) -> None:
        if run.error is None:
            self.reports[name].append(run.report)
            self.finished.add(name)  # the hub had no share left for it
            return
        self._lose(name, str(run.error).splitlines()[0][:160])

    def _trouble(self, name: str) -> str | None:
        """Why a site cannot go on in this round (its ranks broken, its line gone or down too long), or None."""
        cluster = self.sessions[name].cluster
        if cluster is None:
            return "its ranks stopped"
        problem = cluster.infrastructure_problem()
        if problem:
            return problem
        link = cluster.link()  # type: ignore[attr-defined]
        if link is not None and link.detached_for > self.hub.welcome["stale_seconds"]:
            return f"its line has been down for {link.detached_for:.1f} s"
        broken = cluster.broken_ranks()
        return "; ".join(f"rank {rank} {why}" for rank, why in sorted(broken.items())) if broken else None

    def _lose(self, name: str, why: str) -> None:
        self.lost.add(name)
        self.hub.call(_on_loop(self.outer.site_lost, name))
        self.events.append(f"site {name} was lost ({why}); its share was requeued")
        self._say(f"labkit: {self.events[-1]}")

    def _bring_back(self) -> None:
        """A lost site whose line and engines are back: heal it and start its part again (if shares are left)."""
        for name in sorted(self.lost):
            if self.outer.progress()["finished"]:
                return
            if not self.runs[name].done or self.reopen is None:
                continue  # its failed run is still winding down
            link = self.hub.sites().get(name)
            if link is None or link.gone or not link.connected or \
                    len(registered_engines(self.lab.require_running(), name, link.session)) < int(link.info.get("ranks", 1)):
                continue  # its engines have not all registered yet
            try:
                session = self.reopen(name)  # formed anew if the site joined anew
                if session.world_size != self.sessions[name].world_size and self.inner == "fsdp":
                    continue
                self.sessions[name] = session
                session.heal()
                self._start(name)
            except LabError:
                continue  # not yet: its engines are still coming
            self.lost.discard(name)
            self.events.append(f"site {name} came back and rejoined at the next round")
            self._say(f"labkit: {self.events[-1]}")

    def _say_round(self, record: RoundRecord) -> None:
        left = f"; left out: {', '.join(record.left_out)}" if record.left_out else ""
        self._say(f"labkit: round {record.round}: {', '.join(record.used) or 'no site'} in {record.seconds:.1f} s, "
              f"{format_bytes(record.bytes_in)} in, {format_bytes(record.bytes_out)} out{left}")

    def _say(self, line: str) -> None:
        self.lines.append(line)
        if not self.quiet:
            print(line, flush=True)

    # -- the result ----------------------------------------------------------------------

    def _report(self, seconds: float) -> SitesReport:
        for name, run in self.runs.items():
            if run.done and run.error is None and all(run.report is not seen for seen in self.reports[name]):
                self.reports[name].append(run.report)
        progress = self.outer.progress()
        weights = self.hub.call(_on_loop(self.outer.global_weights))
        model_bytes = sum(vector.nbytes for vector in weights.values())
        return SitesReport(list(self.sessions), self.replicas, self.inner_steps, self.wire, progress["rounds"],
                           self._losses(progress["rounds"]), model_bytes, seconds, list(self.events), weights,
                           dict(self.outer.layouts))

    def _losses(self, rounds: list[RoundRecord]) -> list[float]:
        """Per global step (block b, step h): the mean over the sites that trained a slice of block b at step h."""
        by_step: dict[int, list[float]] = {}
        for name, reports in self.reports.items():
            for report in reports:
                joined: list[int] = next((r["sites"] for r in report.strategy_results if "sites" in r), [])
                losses = report.losses
                for index, round_number in enumerate(joined):
                    record = next((r for r in rounds if r.round == round_number), None)
                    if record is None or name not in record.used:
                        continue  # a round it was left out of: its steps made no outer step
                    block = record.shares[name][0]
                    for step in range(self.inner_steps):
                        at = index * self.inner_steps + step
                        if at < len(losses):
                            by_step.setdefault(block * self.inner_steps + step, []).append(losses[at])
        return [statistics.fmean(by_step[step]) for step in sorted(by_step)]

    def _verify(self, report: SitesReport) -> tuple[float, float]:
        """(the hub's weights against one-process DiLoCo, that reference against itself summed in other orders):
        each the largest relative difference of a parameter, as every other verify of the lab measures it."""
        if any(r.left_out for r in report.rounds) or len(report.rounds) != self.blocks:
            raise LabError("verify compares a run in which every site took part in every round; this one left "
                           "sites out, so no one-process run is the same")
        first = next(iter(self.sessions.values()))
        config = replace(self.configs[next(iter(self.sessions))], outer_hub=None, steps=self.blocks * self.inner_steps,
                         strategy="diloco", mesh_names=("replica",), mesh_shape=(self.replicas,))
        reference, resummed = (numpy.frombuffer(flat, dtype=numpy.float32) for flat in
                               first.call([0], entry.diloco_reference, (config,), self.timeout)[0])
        layout = report.layouts[0]
        difference = largest_relative_difference(report.weights[0], reference, layout)
        return difference, largest_relative_difference(resummed, reference, layout)


async def _on_loop(function, *args):
    return function(*args)
