"""Whether the hosts of the SSH launcher answer: what a heal and a failed start ask before naming a host.

A rank started over ssh that is lost would be started again on its host, through ssh; when that host no
longer answers (its link cut, the machine down), ``unreachable_ranks`` says so, with what ssh said, and the
repair drops those ranks instead of waiting for engines that cannot start there. ``ssh_reach_note`` adds the
same to the message of a start that failed. Each host is tried once, all at once, within a few seconds.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

from labkit.cluster.launchers import LauncherChoice

REACH_SECONDS = 5  # how long ssh may take to connect to a host before the lab calls it unreachable


def unreachable_hosts(choice: LauncherChoice, hosts) -> dict[str, str]:
    """Which of ``hosts`` (entries of ssh's ``engines``: 'host', 'user@host', 'host:port') ssh cannot reach now,
    with what ssh said; all are tried at once, each within a few seconds. Another launcher's hosts: none."""
    entries = sorted(set(hosts))
    traits = getattr(choice.engine_class, "class_trait_names", None)  # a site's ranks have no launcher class
    if not entries or traits is None or "ssh_cmd" not in traits(config=True):
        return {}
    ssh = list(choice.options.get("ssh_cmd", ["ssh"]))
    # The user's options first: for ssh the first value given for an option wins.
    args = [*choice.options.get("ssh_args", []), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={REACH_SECONDS}"]

    def probe(entry: str) -> str | None:
        location, _, port = entry.partition(":")
        argv = [*ssh, *args, *(["-p", port] if port else []), location, "true"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=3 * REACH_SECONDS,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"ssh did not connect within {3 * REACH_SECONDS} s"
        except OSError as error:
            return f"ssh could not run: {error}"
        if done.returncode == 255:  # ssh's own failure (connect, authentication), not the command's
            return (done.stderr.strip().splitlines() or ["ssh failed"])[-1]
        return None

    with ThreadPoolExecutor(max_workers=len(entries)) as pool:
        said = dict(zip(entries, pool.map(probe, entries)))
    return {entry: reason for entry, reason in said.items() if reason is not None}


def ssh_reach_note(choice: LauncherChoice) -> str:
    """For a start that failed: '; ssh cannot reach HOST (why)' for each host of ssh's ``engines`` it cannot
    reach now ('' when it reaches them all, or for another launcher)."""
    engines = choice.options.get("engines")
    cut = unreachable_hosts(choice, engines) if isinstance(engines, dict) else {}
    return "".join(f"; ssh cannot reach {host} ({why})" for host, why in sorted(cut.items()))


def unreachable_ranks(cluster, ranks) -> dict[int, str]:
    """Of ``ranks``, those whose launch host (ssh's ``engines`` entry) ssh cannot reach now: rank -> why. Their
    host is forgotten: no signal goes there through ssh any more (each would wait out its timeout)."""
    places = {rank: cluster.records[rank].launched_on for rank in ranks if cluster.records[rank].launched_on}
    cut = unreachable_hosts(cluster.launcher, places.values())
    found = {rank: place for rank, place in places.items() if place in cut}
    for rank in found:
        cluster.records[rank].launched_on = None
    return {rank: f"its host {place} cannot be reached over ssh ({cut[place]})" for rank, place in found.items()}
