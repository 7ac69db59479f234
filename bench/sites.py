"""Sites benchmark: DiLoCo across three firewalled sites against DDP across the same hosts on a flat network.

    ./lab bench sites [--steps 300] [--ddp-steps 60] [--inner-steps 10] [--lost-steps 60] [--target LOSS]

Two networks of network-namespace hosts (``tests/netns_sites.py``), one after the other, with the same
links: each site's link shaped both ways (``tc netem`` 40 ms and 50 Mbit/s where the kernel has netem;
else ``tc tbf`` keeps the 50 Mbit/s and there is no delay: the table says which).

  sites   the hub (the notebook's side, ``tests/multihost_driver.py`` in host 0, a lab of 1 rank) and three
          sites behind firewalls that let out only TCP to the hub's HTTPS port, site 3 only through an HTTP
          CONNECT proxy (tinyproxy). Each site joins with the lab's HTTPS join command and runs 2 ranks.
  flat    the same hosts and links with no firewall: the hub's lab has no rank of its own (``ranks=0``) and
          each site host runs the plain join command twice, so DDP runs on the same 3 x 2 ranks with gloo
          connecting them directly, which only a flat network allows.

Measured:

  join to usable      from starting a site's join command until ``lab.wait_for_sites`` names it and a cell
                      has run on its ranks (site 3 through the proxy).
  training            the zoo's character GPT, lr 3e-3, global batch 24: DiLoCo fused across the sites for
                      ``--steps`` global steps (one replica each, ``--inner-steps`` H, bf16 on the wire) and
                      DDP over the 6 ranks of the flat network for ``--ddp-steps`` (fewer by default: with
                      delay on the links each of its steps waits seconds). For each: wall time of ``lab.train`` (from the
                      call: set-up included), the bytes that crossed each site's link (the interface counters
                      of its host, both directions, everything: TLS, heartbeats, tasks, collectives) per
                      global step, and the time from the call to a target loss: the first block of H steps
                      whose mean training loss is at most the target (``--target``; by default the higher of
                      the two runs' best block means, so both reach it). A DiLoCo block counts as reached when
                      the hub closed the last round that trained one of its slices.
  hub bytes per round the outer sync's bytes through the hub per full round (pseudo-gradients in, updates
                      out) against 2 x sites x model bytes in the wire's precision.
  lost site           a second DiLoCo run (``--lost-steps``); after its second round the bench SIGKILLs site
                      2's join command (its ranks with it): seconds from the kill until the hub closed the
                      round without it.

Needs root, iproute2, nftables or iptables, and tinyproxy (exits with code 2, saying why, when the network
cannot be built). Writes bench/results/sites.json. Every host is a namespace on this one machine and all
ranks share its cores: the times are this machine's, the bytes are the protocol's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests package: the namespace network and the notebook-side driver

from multihost import Driver, join  # noqa: E402
from results_file import write_results  # noqa: E402
from tests.multihost_driver import ANSWER, DriverError  # noqa: E402
from tests.netns_sites import SiteNetwork, SiteProcess, site_network_unavailable  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sites.json"
HTTPS_PORT = 8443
NAMES = {1: "east", 2: "west", 3: "north"}
RANKS_PER_SITE = 2
SETTINGS = dict(model="gpt", lr=3e-3, global_batch=24)
LAB = dict(backend="gloo", threads_per_rank=1, timeout=1800, start_timeout=120)

# Run in the driver (``exec``, with ``lab``): a DiLoCo run across the sites, summed up by ``finish``. Clocks:
# the hub's rounds are stamped with time.monotonic(), which every process of this machine shares.
TRAIN_DILOCO = """
import statistics, time

def finish(report):
    rounds = [dict(round=r.round, used=list(r.used), left_out=list(r.left_out), opened=r.opened,
                   closed=r.opened + r.seconds, shares={{k: list(v) for k, v in r.shares.items()}},
                   bytes_in=r.bytes_in, bytes_out=r.bytes_out) for r in report.rounds]
    trained = {{}}  # block -> when the hub closed the last round that trained one of its slices
    for entry in rounds:
        for site in entry['used']:
            block = entry['shares'][site][0]
            trained[block] = max(trained.get(block, 0.0), entry['closed'])
    H, losses = report.inner_steps, report.losses
    blocks = [(statistics.fmean(losses[b * H:(b + 1) * H]), trained[b] - began)
              for b in sorted(trained) if (b + 1) * H <= len(losses)]
    wire_bytes = 2 if report.wire == 'bf16' else 4
    return dict(seconds=time.monotonic() - began, losses=losses, blocks=blocks, rounds=rounds, wire=report.wire,
                model_bytes=report.model_bytes, hub_bytes_per_round=report.hub_bytes_per_round,
                full_round_bytes=2 * len(report.sites) * report.model_bytes * wire_bytes // 4)

began = time.monotonic()
if {background}:
    run = lab.train('diloco', sites={sites!r}, background=True, **{settings!r})
else:
    result = finish(lab.train('diloco', sites={sites!r}, **{settings!r}))
"""

# Run in the driver: DDP over the flat lab's ranks; each step's end is the slowest rank's (rows' wall clock).
TRAIN_DDP = """
import statistics, time
began = time.time()
report = lab.train('ddp', log_every=10**9, **{settings!r})
seconds = time.time() - began
ends = {{}}
for account in report.results:
    for row in account['rows']:
        ends[row['step']] = max(ends.get(row['step'], 0.0), row['start'] + row['seconds'])
losses, H = report.losses, {block}
blocks = [(statistics.fmean(losses[b * H:(b + 1) * H]), ends[(b + 1) * H - 1] - began)
          for b in range(len(losses) // H) if (b + 1) * H - 1 in ends]
result = dict(seconds=seconds, losses=losses, blocks=blocks, median_step_seconds=report.median_step_seconds,
              comm_bytes_per_rank=report.comm_bytes_per_rank, rows_kept=len(ends))
"""


def link_bytes(network: SiteNetwork) -> dict[str, int]:
    """Bytes that crossed each site's link so far, both directions (its host's end of the veth pair)."""
    counted = {}
    for site, name in NAMES.items():
        shown = subprocess.run(["ip", "-n", network.namespace(network.site_host(site)), "-s", "-j", "link", "show",
                                "dev", network.hosts.interface(network.site_host(site))],
                               capture_output=True, text=True, check=True, timeout=10).stdout
        stats = json.loads(shown)[0]["stats64"]
        counted[name] = stats["rx"]["bytes"] + stats["tx"]["bytes"]
    return counted


def crossed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in before}


def time_to_target(blocks: list[tuple[float, float]], target: float) -> float | None:
    """Seconds from the call at which the first block of (mean loss, reached at) came to ``target``."""
    return next((reached for loss, reached in blocks if loss <= target), None)


def run_sites(network: SiteNetwork, options, logs: Path) -> dict:
    """Joins, fused DiLoCo and a lost site on the firewalled network."""
    out: dict = {"links": network.links}
    driver = Driver(network, "hub")
    sites: list[SiteProcess] = []
    try:
        started = driver.ask(180, command="start", ranks=1, **LAB)
        command = driver.ask(30, command="exec", code=(
            f"result = lab.join_command(https=True, address={network.hub_address!r}, port={HTTPS_PORT})"))["result"]
        print(f"  hub lab started in {started['seconds']:.2f} s; links: {network.links}", flush=True)
        joins = {}
        for site, name in NAMES.items():
            began = time.monotonic()
            sites.append(SiteProcess(network, site, command, name, RANKS_PER_SITE, None, logs))
            formed = driver.ask(240, command="exec", code=(
                f"lab.wait_for_sites(names=[{name!r}], timeout=200)\nresult = lab.site({name!r}).run_cell('rank')"))
            joins[name] = time.monotonic() - began
            assert formed["result"] == [str(rank) for rank in range(RANKS_PER_SITE)], formed
            via = " (through the proxy)" if site in network.proxied else ""
            print(f"  {name} joined{via}: usable after {joins[name]:.2f} s", flush=True)
        out["join_to_usable_seconds"] = joins

        before = link_bytes(network)
        fused = driver.ask(1800, command="exec", code=TRAIN_DILOCO.format(
            settings=dict(SETTINGS, steps=options.steps, inner_steps=options.inner_steps), sites=list(NAMES.values()),
            background=False))["result"]
        out["diloco"] = dict(fused, link_bytes=crossed(before, link_bytes(network)))
        print(f"  DiLoCo across the sites: {fused['seconds']:.1f} s, loss {fused['losses'][0]:.3f} -> "
              f"{fused['losses'][-1]:.3f}", flush=True)

        lost = driver.ask(60, command="exec", code=TRAIN_DILOCO.format(
            settings=dict(SETTINGS, steps=options.lost_steps, inner_steps=options.inner_steps),
            sites=list(NAMES.values()), background=True))
        assert lost["ok"], lost
        driver.ask(300, command="exec", code=(
            "import time\nwhile run.progress()['round'] < 2 and not run.done:\n    time.sleep(0.02)\n"))
        killed_at = time.monotonic()
        sites[1].kill()
        ended = driver.ask(900, command="exec", code="result = finish(run.wait(880))")["result"]
        left = [entry for entry in ended["rounds"] if "west" in entry["left_out"]]
        out["lost_site"] = {"killed_round": left[0]["round"] if left else None,
                            "kill_to_round_closed_seconds": (left[0]["closed"] - killed_at) if left else None,
                            "rounds": ended["rounds"]}
        if left:
            print(f"  west killed: round {left[0]['round']} closed without it "
                  f"{out['lost_site']['kill_to_round_closed_seconds']:.2f} s after the kill", flush=True)
        else:
            print("  west killed, but no round left it out (the run ended first: give more --lost-steps)", flush=True)
    finally:
        driver.stop()
        for site in sites:
            site.kill()
    return out


def run_flat(network: SiteNetwork, options, logs: Path) -> dict:
    """DDP over the same 3 x 2 ranks, directly connected (no firewall)."""
    driver = Driver(network, "flat")
    joiners = []
    try:
        # A lab of no ranks of its own waits in start() for engines to join, printing the join line first.
        driver.process.stdin.write(json.dumps(dict(command="start", ranks=0, controller_address=network.hub_address,
                                                   **LAB)) + "\n")
        driver.process.stdin.flush()
        deadline, line = time.monotonic() + 120, ""
        while not line.startswith("python -m labkit join "):
            line = driver.lines.get(timeout=max(0.1, deadline - time.monotonic())) or ""
        world = len(NAMES) * RANKS_PER_SITE
        for site, name in NAMES.items():
            for copy in range(RANKS_PER_SITE):
                log = open(logs / f"flat-{name}-{copy}.log", "w")
                command = f"{sys.executable} -m labkit join {line.split()[-1]}"  # this environment's python
                joiners.append((join(network.hosts, network.site_host(site), command, f"flat-{name}", log), log))
        answered = ""
        while not answered.startswith(ANSWER):  # start()'s own answer, once the first engine is a rank
            answered = driver.lines.get(timeout=max(0.1, deadline + 60 - time.monotonic())) or ""
        if not json.loads(answered[len(ANSWER):])["ok"]:
            raise DriverError(f"flat lab: start failed: {answered}")
        grown = driver.ask(300, command="grow", world=world, within=240)
        assert grown["world"] == world, grown
        print(f"  flat lab: {world} ranks on hosts {sorted(set(grown['hosts']))}", flush=True)
        before = link_bytes(network)
        trained = driver.ask(3600, command="exec", code=TRAIN_DDP.format(
            settings=dict(SETTINGS, steps=options.ddp_steps), block=options.inner_steps))["result"]
        out = dict(trained, link_bytes=crossed(before, link_bytes(network)), links=network.links)
        print(f"  DDP on the flat network: {trained['seconds']:.1f} s, loss {trained['losses'][0]:.3f} -> "
              f"{trained['losses'][-1]:.3f}, median step {trained['median_step_seconds'] * 1000:.0f} ms", flush=True)
        return out
    finally:
        driver.stop()
        for process, log in joiners:
            if process.poll() is None:
                process.kill()
            process.wait(10)
            log.close()


def table(sites: dict, flat: dict, options) -> list[dict]:
    diloco, ddp = sites["diloco"], flat
    target = options.target
    if target is None:  # the loss both runs reach: the worse of their best block means
        target = max(min(loss for loss, _ in diloco["blocks"]), min(loss for loss, _ in ddp["blocks"]))
    rows = [
        ("wall time of lab.train (s)", diloco["seconds"], ddp["seconds"]),
        (f"time to mean loss <= {target:.3f} (s)", time_to_target(diloco["blocks"], target) or "not reached",
         time_to_target(ddp["blocks"], target) or "not reached"),
        ("steps", options.steps, options.ddp_steps),
        ("final block mean loss", diloco["blocks"][-1][0], ddp["blocks"][-1][0]),
        ("bytes over a site's link per step (kB)",
         statistics.fmean(diloco["link_bytes"].values()) / options.steps / 1e3,
         statistics.fmean(ddp["link_bytes"].values()) / options.ddp_steps / 1e3),
        ("median step (ms)", None, ddp["median_step_seconds"] * 1000),
    ]
    print(f"\n{'metric':<42} {'DiLoCo, sites':>14} {'DDP, flat':>12} {'ratio':>8}")
    out = []
    for name, a, b in rows:
        numbers = all(isinstance(value, (int, float)) and value for value in (a, b))
        ratio = b / a if numbers else None
        shown = [f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)
                 for value in (a, b)]
        print(f"{name:<42} {shown[0]:>14} {shown[1]:>12} {f'{ratio:.2f}x' if ratio else '':>8}")
        out.append({"metric": name, "diloco_sites": a, "ddp_flat": b, "ddp_over_diloco": ratio})
    full = diloco["full_round_bytes"]
    print(f"\nhub bytes per full round: {diloco['hub_bytes_per_round'] / 1e3:.1f} kB against 2 x sites x model "
          f"= {full / 1e3:.1f} kB ({diloco['wire']}; model {diloco['model_bytes'] / 1e3:.1f} kB in float32): "
          f"{diloco['hub_bytes_per_round'] / full:.3f}x")
    for name, seconds in sites["join_to_usable_seconds"].items():
        print(f"join to usable, {name}: {seconds:.2f} s")
    lost = sites["lost_site"]["kill_to_round_closed_seconds"]
    print(f"lost site: round closed without it {lost:.2f} s after the kill" if lost is not None
          else "lost site: not measured (the run ended before a round left it out)")
    print(f"links: {sites['links']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="global steps of DiLoCo across the sites")
    parser.add_argument("--ddp-steps", type=int, default=60, help="steps of DDP on the flat network (each waits on "
                                                                   "the links: seconds where they have delay)")
    parser.add_argument("--inner-steps", type=int, default=10, help="DiLoCo's H, also the loss block")
    parser.add_argument("--lost-steps", type=int, default=60, help="global steps of the run that loses a site")
    parser.add_argument("--target", type=float, default=None, help="target loss (default: both runs reach it)")
    options = parser.parse_args()
    if options.steps % options.inner_steps or options.ddp_steps % options.inner_steps \
            or options.lost_steps < 4 * options.inner_steps:
        parser.error("--steps and --ddp-steps must be multiples of --inner-steps, and --lost-steps at least 4 rounds")
    if (reason := site_network_unavailable(shaping=False)) is not None:
        print(f"cannot build the site network here: {reason}", file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    logs = Path(tempfile.mkdtemp(prefix="labkit-bench-sites-"))
    with SiteNetwork(sites=3, proxied=(3,), https_port=HTTPS_PORT) as network:
        sites = run_sites(network, options, logs)
    with SiteNetwork(sites=3, proxied=(), https_port=HTTPS_PORT, firewall="off") as network:
        flat = run_flat(network, options, logs)
    rows = table(sites, flat, options)
    write_results(RESULTS, {"options": vars(options), "rows": rows, "sites": sites, "flat": flat})


if __name__ == "__main__":
    main()
