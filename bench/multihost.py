"""Multi-host benchmark: 4 ranks on one host (loopback) against 4 ranks on three network-namespace hosts,
and a 4-rank lab started through each launcher on those hosts.

    ./lab bench multihost [--part both|hosts|launchers] [--steps 30] [--repeats 1] [--sizes 4096 262144 4194304]
                          [--iters 10] [--launcher-steps 20]

**hosts** (the first part):

Both labs have 4 gloo ranks with one thread each, and both are driven by the notebook side
of the multi-host tests (``tests/multihost_driver.py``) running inside host 0 of
``NetnsHosts(count=3)``:

  loopback    ``Lab(ranks=4)`` with the default controller address (127.0.0.1): every rank
              on host 0, every byte over its loopback interface.
  namespaces  ``Lab(ranks=2, controller_address=<host 0's address>)`` in host 0, plus one
              engine joined from each of hosts 1 and 2 with the lab's join command (each under
              ``unshare --uts`` with a host name of its own): 4 ranks on 3 hosts.

Both labs are up at the same time (one idles while the other is measured) and the order
alternates between repeats, so drift of this shared 2-core machine hits both sides alike.
For each it measures:

  lab start      the ``seconds`` of the driver's start answer: ``Lab(...).start()``.
  ddp step       median step time of the slowest rank (first step left out) of
                 ``lab.train("ddp", MODEL, steps=--steps)`` for the zoo's mlp and gpt,
                 after a 3-step warm-up run of each.
  all-reduce     ``lab.bench_collective("all_reduce", sizes, iterations)``: time and bus
                 bandwidth (as nccl-tests counts it) per size, slowest rank.

and, for the namespace lab, the time for a joined engine to become a usable rank: from
starting the join command in its host (popen) until ``heal()`` has made it a rank (the
driver's ``grow`` answers with the world size reached) and an all-reduce over the grown
world has come back right. Measured for both joiners: host 1 (world 2 -> 3) and host 2
(world 3 -> 4). A table prints metric | loopback | namespaces | ratio (namespaces/loopback).

The namespace "network" is veth pairs on one Linux bridge, all on this machine: it measures
what separate network stacks and addresses cost (gloo over a veth interface and the bridge
instead of loopback, joined engines that are separate "machines" to the lab), not a physical
network's bandwidth or latency.

**launchers** (the second part): the time from ``%lab start`` (``Lab(ranks=4, ...).start()`` in the driver, host
0) to a ready 4-rank lab through each launcher, side by side in one run, and the DDP step (the zoo's mlp,
``--launcher-steps`` steps after a 3-step warm-up, median of the slowest rank) on the ranks it started:

  hosted    the lab's own launcher: 4 ranks forked on host 0, controller on 127.0.0.1 (the loopback baseline);
  mpi       MPICH's ``mpiexec -n 4`` on host 0 (its hydra starts local processes; across hosts it would need
            ssh or a resource manager of its own);
  ssh       OpenSSH servers on hosts 1 and 2 (``tests/netns_ssh.py``), 2 engines each, controller on host 0;
  slurm     slurmctld on host 0 and a slurmd on hosts 1 and 2 (``tests/netns_slurm.py``): one sbatch job of 4
            tasks, 2 on each node.

A launcher whose packages are missing is left out, saying what to install. Needs root, iproute2 and
unshare (exits with code 2, saying why, when namespaces cannot be made). Writes bench/results/multihost.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests package: the namespace hosts and the notebook-side driver

from results_file import write_results  # noqa: E402
from tests.multihost_driver import DriverClient, DriverError  # noqa: E402
from tests.netns_hosts import NetnsHosts, netns_unavailable  # noqa: E402
from tests.netns_slurm import SlurmHosts, slurm_unavailable  # noqa: E402
from tests.netns_ssh import SshHosts, ssh_unavailable  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "multihost.json"
COMMON = dict(backend="gloo", threads_per_rank=1, timeout=300, start_timeout=120)  # a cell's limit: 300 s
QUIET = dict(log_every=10**9)
MODELS = ("mlp", "gpt")
EXPLANATION = (
    "The namespace hosts are Linux network namespaces on this one machine, each with its own network stack "
    "and address (198.18.0.x/24), joined by veth pairs to one Linux bridge. The namespace lab's gloo ranks "
    "talk over those veth interfaces and the bridge (the two ranks in host 0 over host 0's veth address), "
    "the loopback lab's over 127.0.0.1. So the ratios measure what real separate network stacks, addresses and "
    "joined engines cost, not a physical network: no wire, NIC or switch is involved, and all ranks share "
    "the same 2 cores.")


class Driver(DriverClient):
    """The test's driver client; an answer that is not ok raises, unless its error contains ``tolerate``."""

    def ask(self, answer_within: float, tolerate: str | None = None, **command) -> dict:
        reply = super().ask(answer_within, **command)
        if not reply.get("ok") and not (tolerate and tolerate in reply.get("error", "")):
            raise DriverError(f"{self.name} lab: {command['command']} failed: {reply.get('error')}\n"
                              f"{reply.get('trace', '')}{reply['printed'][-2000:]}")
        return reply

    def stop(self) -> float | None:
        """Stop the lab (if the driver still runs); the stop answer's seconds."""
        if self.process.poll() is not None:
            return None
        try:
            seconds = self.ask(90, command="stop")["seconds"]
        except DriverError as error:
            print(f"  warning: {error}", flush=True)
            return None
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            print(f"  warning: the {self.name} driver did not exit within 30 s of stop", flush=True)
        return seconds


def join(hosts: NetnsHosts, index: int, command: str, name: str, log) -> subprocess.Popen:
    """Run the join command in host ``index``, under a host name of its own; its output goes to ``log``."""
    shell = f"hostname {name} && exec {command}"
    return hosts.popen(index, ["unshare", "--uts", "sh", "-c", shell], stdout=log, stderr=subprocess.STDOUT,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))


def timed_join(hosts: NetnsHosts, driver: Driver, index: int, command: str, world: int, log) -> tuple[subprocess.Popen, dict]:
    """Start a joiner in host ``index``; seconds until it is a rank of a ``world``-rank lab that all-reduces right."""
    began = time.monotonic()
    process = join(hosts, index, command, f"lab-host{index}", log)
    grown = driver.ask(180, command="grow", world=world, within=150)
    grown_at = time.monotonic() - began
    if grown["world"] != world:
        log.flush()
        raise DriverError(f"the engine joined from host {index} did not become a rank within 150 s (world "
                          f"{grown['world']}); join output: {Path(log.name).read_text()[-2000:]}")
    summed = driver.ask(120, command="all_reduce", rounds=1)
    usable = time.monotonic() - began
    if summed["sums"] != [float(world)] * world:
        raise DriverError(f"all-reduce after the join from host {index} gave {summed['sums']}")
    print(f"  host {index} joined: a rank after {grown_at:.2f} s, all-reduced after {usable:.2f} s "
          f"(world {world}, hosts {grown['hosts']})", flush=True)
    return process, {"host": index, "world": world, "to_rank_seconds": grown_at, "usable_seconds": usable,
                     "grow_answer_seconds": grown["seconds"], "all_reduce_seconds": summed["seconds"],
                     "hosts": grown["hosts"], "places": grown["places"]}


def measure(driver: Driver, steps: int, sizes: list[int], iters: int) -> dict:
    """One round of every measurement on one lab."""
    out = {}
    for model in MODELS:
        trained = driver.ask(420, command="train", strategy="ddp", model=model, steps=steps, **QUIET)
        if trained["world"] != 4:
            raise DriverError(f"{driver.name} lab trained on {trained['world']} ranks, not 4")
        out[f"ddp_{model}_step_seconds"] = trained["step_seconds"]
    rows = driver.ask(420, command="bench", sizes=sizes, iters=iters)["rows"]
    out["all_reduce"] = {str(size): {"seconds": seconds, "algbw": algbw, "busbw": busbw}
                         for size, seconds, algbw, busbw in rows}
    return out


def median_of(rounds: list[dict]) -> dict:
    merged = {f"ddp_{model}_step_seconds": statistics.median(r[f"ddp_{model}_step_seconds"] for r in rounds)
              for model in MODELS}
    merged["all_reduce"] = {size: {key: statistics.median(r["all_reduce"][size][key] for r in rounds)
                                   for key in ("seconds", "algbw", "busbw")} for size in rounds[0]["all_reduce"]}
    return merged


def format_size(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def table(loop: dict, ns: dict, sizes: list[int]) -> list[dict]:
    rows = [("lab start (s)", loop["start_seconds"], ns["start_seconds"], 1.0)]
    for model in MODELS:
        key = f"ddp_{model}_step_seconds"
        rows.append((f"ddp {model} step (ms)", loop[key], ns[key], 1000.0))
    for size in sizes:
        a, b = loop["all_reduce"][str(size)], ns["all_reduce"][str(size)]
        rows.append((f"all_reduce {format_size(size)} time (us)", a["seconds"], b["seconds"], 1e6))
        rows.append((f"all_reduce {format_size(size)} busbw (MB/s)", a["busbw"], b["busbw"], 1e-6))
    out = []
    print(f"\n{'metric':<32} {'loopback':>10} {'namespaces':>11} {'ratio':>7}")
    for name, a, b, scale in rows:
        ratio = b / a
        print(f"{name:<32} {a * scale:>10.2f} {b * scale:>11.2f} {ratio:>6.2f}x")
        out.append({"metric": name, "loopback": a * scale, "namespaces": b * scale, "ratio": ratio})
    return out


def run(options) -> dict:
    sizes, steps, iters = options.sizes, options.steps, options.iters
    logs = tempfile.mkdtemp(prefix="labkit-bench-multihost-")
    results: dict = {}
    with NetnsHosts(count=3) as hosts:
        loopback = namespaces = None
        joiners = []
        try:
            loopback = Driver(hosts, "loopback")
            started = loopback.ask(180, command="start", ranks=4, **COMMON)
            status = loopback.ask(30, command="status")
            if status["world"] != 4:
                raise DriverError(f"loopback lab: {status['world']} ranks after start, not 4: {status['status']}")
            loop = {"start_seconds": started["seconds"], "status": status["status"]}
            print(f"  loopback lab started in {started['seconds']:.2f} s (4 ranks on host 0, controller on "
                  "127.0.0.1)", flush=True)

            namespaces = Driver(hosts, "namespaces")
            started = namespaces.ask(180, command="start", ranks=2, controller_address=hosts.address(0), **COMMON)
            ns = {"start_seconds": started["seconds"], "plan": started["plan"]}
            print(f"  namespace lab started in {started['seconds']:.2f} s: {started['plan']}", flush=True)
            joins = []
            for index, world in ((1, 3), (2, 4)):
                log = open(os.path.join(logs, f"join-host{index}.log"), "w")
                process, row = timed_join(hosts, namespaces, index, started["join"], world, log)
                joiners.append((process, log))
                joins.append(row)
            ns["hosts"], ns["places"] = joins[-1]["hosts"], joins[-1]["places"]

            for driver in (loopback, namespaces):  # warm every rank's imports and allocator for both models
                for model in MODELS:
                    driver.ask(420, command="train", strategy="ddp", model=model, steps=3, **QUIET)
            print("  both labs warmed up", flush=True)
            rounds = {"loopback": [], "namespaces": []}
            for repeat in range(options.repeats):
                order = (loopback, namespaces) if repeat % 2 == 0 else (namespaces, loopback)
                for driver in order:
                    rounds[driver.name].append(measure(driver, steps, sizes, iters))
                    print(f"  repeat {repeat + 1}: {driver.name} measured", flush=True)
            loop.update(median_of(rounds["loopback"]), rounds=rounds["loopback"])
            ns.update(median_of(rounds["namespaces"]), rounds=rounds["namespaces"])
        finally:
            for driver in (namespaces, loopback):
                if driver is not None:
                    driver.stop()
            for process, log in joiners:
                try:
                    code = process.wait(30)
                except subprocess.TimeoutExpired:
                    code = None
                    print(f"  warning: a joined engine ({log.name}) outlived its lab by 30 s", flush=True)
                log.close()
                if code not in (0, None):
                    said = Path(log.name).read_text().strip().splitlines()
                    print(f"  note: the join command in {Path(log.name).stem[5:]} exited with code {code} after the "
                          f"lab stopped (it said: {said[-1] if said else 'nothing'})", flush=True)

    print(f"\nDDP ({steps} steps, median step of the slowest rank) and all-reduce ({iters} iterations) on 4 gloo "
          f"ranks, 1 thread each; medians of {options.repeats} repeat(s)")
    results["table"] = table(loop, ns, sizes)
    print("\ntime for a joined engine to become a usable rank (join command started -> heal made it a rank -> "
          "an all-reduce over the grown world came back right):")
    for row in joins:
        print(f"  from host {row['host']} (world {row['world'] - 1} -> {row['world']}): {row['usable_seconds']:.2f} s "
              f"({row['to_rank_seconds']:.2f} s to become a rank, then the all-reduce)")
    print(f"\n({EXPLANATION})")
    shutil.rmtree(logs, ignore_errors=True)
    results.update(loopback=loop, namespaces=ns, joins=joins)
    return results


LAUNCHERS = ("hosted", "mpi", "ssh", "slurm")


def launcher_unavailable(name: str) -> str | None:
    """Why ``name`` cannot run on the namespace hosts here (what to install), or None."""
    if name == "mpi":
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        return None if shutil.which("mpiexec") or os.access(beside, os.X_OK) else "no mpiexec: pip install mpich"
    return {"ssh": ssh_unavailable, "slurm": slurm_unavailable}.get(name, lambda: None)()


def start_through(name: str, hosts: NetnsHosts, ssh: SshHosts | None, slurm: SlurmHosts | None,
                  stderr=None) -> tuple[Driver, dict]:
    """A driver in host 0 (its stderr to ``stderr``) and the start options of a 4-rank lab through ``name``."""
    options = dict(ranks=4, launcher=name, **COMMON)
    environment = None
    if name == "ssh":
        options.update(controller_address=hosts.address(0), **ssh.launcher_options({1: 2, 2: 2}))
    elif name == "slurm":
        options.update(controller_address=hosts.address(0))
        environment = slurm.environment
    return Driver(hosts, name, environment=environment, stderr=stderr), options


RANK_HOSTS = "result = [lab.cluster.records[rank].host for rank in sorted(lab.cluster.records)]"


def launchers_part(wanted=LAUNCHERS, steps: int = 20, verify: bool = False) -> dict:
    """Each launcher of ``wanted`` in turn, a 4-rank lab on the same namespace hosts: time to ready, DDP step
    (``verify``: checked equal to one process), time to stop. One that cannot run here is left out, saying why.
    Notebook 11 calls this too."""
    names = []
    for name in wanted:
        why = launcher_unavailable(name)
        if why:
            print(f"  {name}: left out here ({why})", flush=True)
        else:
            names.append(name)
    if not names:
        return {}
    rows = {}
    with NetnsHosts(count=3) as hosts:
        # A launcher's servers only where it is measured (nullcontext gives None).
        with (SshHosts(hosts, on=(1, 2)) if "ssh" in names else contextlib.nullcontext()) as ssh, \
                (SlurmHosts(hosts, nodes=(1, 2)) if "slurm" in names else contextlib.nullcontext()) as slurm:
            for name in names:
                rows[name] = one_launcher(name, hosts, ssh, slurm, steps, verify)
                if slurm is not None:
                    rows[name]["jobs_after_stop"] = slurm.jobs()
    base = rows.get("hosted", {}).get("ddp_mlp_step_seconds")
    print(f"\n{'launcher':<10} {'ready (s)':>10} {'ddp mlp step (ms)':>18} {'step / hosted':>14} {'stop (s)':>9}  ranks on")
    for name, row in rows.items():
        row["step_over_hosted"] = row["ddp_mlp_step_seconds"] / base if base else None
        ratio = f"{row['step_over_hosted']:.2f}x" if base else "-"
        hosts_of = ", ".join(f"{host} x{row['rank_hosts'].count(host)}" for host in sorted(set(row["rank_hosts"])))
        print(f"{name:<10} {row['ready_seconds']:>10.2f} {row['ddp_mlp_step_seconds'] * 1000:>18.1f} "
              f"{ratio:>14} {row['stop_seconds'] or float('nan'):>9.2f}  {hosts_of}")
    return rows


def one_launcher(name: str, hosts: NetnsHosts, ssh, slurm, steps: int, verify: bool) -> dict:
    """Start a 4-rank lab through ``name``, train DDP on it, stop it; what was measured."""
    # The driver's stderr (torch's warnings about the hosts' names, ipyparallel's profile notes) to a file, read
    # back only if it fails.
    said = tempfile.TemporaryFile(mode="w+")
    driver, start = start_through(name, hosts, ssh, slurm, stderr=said)
    try:
        began = time.monotonic()
        started = driver.ask(240, **start, command="start")
        ready = time.monotonic() - began
        placed = driver.ask(30, command="exec", code=RANK_HOSTS)["result"]
        driver.ask(420, command="train", strategy="ddp", model="mlp", steps=3, **QUIET)
        trained = driver.ask(420, command="train", strategy="ddp", model="mlp", steps=steps, verify=verify, **QUIET)
        if verify and trained["equivalent"] is not True:
            raise DriverError(f"{name}: DDP over its ranks did not verify equal to one process: {trained['text']}")
    except DriverError as error:
        said.seek(0)
        raise DriverError(f"{error}\nthe driver's stderr: {said.read()[-3000:]}") from None
    finally:
        stopped = driver.stop()
        said.close()
    print(f"  {name}: ready in {ready:.2f} s, ddp mlp step {trained['step_seconds'] * 1000:.1f} ms"
          f"{', verified equal to one process' if verify else ''}, stopped in {stopped or float('nan'):.2f} s; "
          f"ranks on {', '.join(placed)}", flush=True)
    return {"ready_seconds": ready, "start_answer_seconds": started["seconds"], "rank_hosts": placed,
            "ddp_mlp_step_seconds": trained["step_seconds"], "stop_seconds": stopped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each DDP run (mlp and gpt)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every measurement on each lab (medians)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 262144, 4194304],
                        help="all-reduce message sizes in bytes")
    parser.add_argument("--iters", type=int, default=10, help="all-reduce iterations per size")
    parser.add_argument("--part", choices=("both", "hosts", "launchers"), default="both",
                        help="hosts: loopback against namespace hosts; launchers: each launcher's 4-rank lab")
    parser.add_argument("--launcher-steps", type=int, default=20, help="DDP steps measured on each launcher's lab")
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    why = netns_unavailable() or (None if shutil.which("unshare") else "util-linux's `unshare` is not installed")
    if why:
        print(f"multihost benchmark needs network namespaces: {why}", file=sys.stderr)
        sys.exit(2)
    began = time.time()
    settings = {key: value for key, value in vars(options).items() if key not in ("out", "part", "launcher_steps")}
    results = {}
    if options.part in ("both", "hosts"):
        results = {"settings": {**settings, "ranks": 4, "backend": "gloo", "threads_per_rank": 1,
                                "models": list(MODELS), "strategy": "ddp"}, "namespace_link": EXPLANATION}
    if options.part in ("both", "hosts"):
        results.update(run(options))
    if options.part in ("both", "launchers"):
        print("\na 4-rank lab through each launcher on the namespace hosts (time from start to ready):", flush=True)
        results["launchers"] = {"settings": {"ranks": 4, "backend": "gloo", "threads_per_rank": 1, "model": "mlp",
                                             "steps": options.launcher_steps, "when": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                "rows": launchers_part(steps=options.launcher_steps)}
    results[f"seconds_{options.part}"] = time.time() - began
    if options.part != "both" and options.out.exists():  # one part run again: the other part's results stay
        results = {**json.loads(options.out.read_text()), **results}
    print(f"\nwhole benchmark: {(time.time() - began) / 60:.1f} min on {os.cpu_count()} cores")
    write_results(options.out, results)


if __name__ == "__main__":
    main()
