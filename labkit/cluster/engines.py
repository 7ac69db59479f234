"""Engines registered with the lab's controller, and how they become ranks.

An engine registers knowing nothing of ranks. The cluster asks each new one
what it is (``entry.describe_engine``: its host, its pid, how it came) and
gives it a rank: a hosted engine the rank its engine set was started for,
another launcher's engines in the order they came, joined engines after all
the others. Every rank is told its place in one message (``entry.become_rank``):
its number, the world's size, its host's number and its own on that host
(as torchrun numbers them), the controller's address and ports.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from labkit.cluster import health
from labkit.cluster.placement import check_host_places, host_layout
from labkit.spec.errors import LabError, StartupError
from labkit.wire import entry as rank_entry
from labkit.wire.rank_settings import RankSettings

JOINED = "joined"
SITE_PREFIX = "site:"  # a site's engine, "site:<name>@<line session>": it came over that line (cluster.site_agent)


def site_of(slot: str) -> str | None:
    """The site an engine came from, None for any other engine."""
    return slot[len(SITE_PREFIX):].split("@", 1)[0] if slot.startswith(SITE_PREFIX) else None


def line_session_of(slot: str) -> str | None:
    """The line session a site's engine came over (a site that joined anew has another)."""
    return slot.split("@", 1)[1] if slot.startswith(SITE_PREFIX) and "@" in slot else None


@dataclass
class RankRecord:
    """One rank: its engine, its process, where it runs and how it came."""

    engine: int
    pid: int
    host: str
    slot: str  # "rank3" (hosted), "set:ranks2" (another launcher's engine set), "joined"
    engine_set: str | None  # the launcher's engine set; None for a joined engine
    gpus: int = 0  # how many GPUs its process saw when it registered (``entry.describe_engine``)
    # Those GPUs as its engine names them; None where the engine did not say (an older labkit): its
    # host is then checked by count alone.
    gpu_ids: tuple[str, ...] | None = None
    # The host entry it was started by, where the launcher names hosts (ssh's ``engines``): a replacement
    # starts there again. None for other launchers.
    launched_on: str | None = None

    @property
    def joined(self) -> bool:
        return self.slot == JOINED


def connection_info(profile_dir: str) -> dict:
    """ipyparallel's engine connection file of the controller whose profile is ``profile_dir``."""
    security = os.path.join(profile_dir, "security")
    name = next(name for name in os.listdir(security) if name.endswith("engine.json"))
    with open(os.path.join(security, name)) as handle:
        return json.load(handle)


def controller_ports(connection: dict) -> set[int]:
    """Every port the controller listens on: a failing rank keeps its connections to them."""
    ports = set()
    for value in connection.values():
        for port in value if isinstance(value, list) else [value]:
            if isinstance(port, int) and not isinstance(port, bool):
                ports.add(port)
    return ports


def new_engines(cluster) -> list[int]:
    """Registered engines that are not (or no longer) ranks."""
    known = {record.engine for record in cluster.records.values()} | cluster.retired_engines
    return [engine for engine in cluster.client.ids if engine not in known]


def describe(cluster, engines) -> dict[int, dict]:
    """What each engine says it is, asked once: the answer is kept (``cluster.descriptions``, which a lab's
    sites share), so the engines of a site, never a rank of the lab itself, are not asked at every heal."""
    found = {}
    for engine in engines:
        if engine in cluster.descriptions:
            found[engine] = cluster.descriptions[engine]
            continue
        try:
            found[engine] = cluster.descriptions[engine] = cluster.client[engine].apply_sync(
                rank_entry.describe_engine)
        except Exception:  # an engine that died after registering
            cluster.retired_engines.add(engine)
    return found


def wait_for_launched(cluster, count: int, deadline: float) -> list[tuple[int, dict]]:
    """Wait until ``count`` launched engines registered: (engine id, description), hosted ones by rank."""
    found: list[tuple[int, dict]] = []
    seen = set()
    while len(found) < count:
        new = [engine for engine in new_engines(cluster) if engine not in seen]
        seen.update(new)
        found += [(engine, info) for engine, info in describe(cluster, new).items()
                  if info["slot"] != JOINED and site_of(info["slot"]) is None]
        if new:
            continue
        dead = health.launch_failures(cluster)
        never = health.never_starting(cluster)
        if dead or never or time.monotonic() > deadline:
            raise StartupError(health.startup_failure(cluster, count - len(found), dead, never))
        time.sleep(0.02)
    return sorted(found, key=lambda item: _hosted_rank(item[1]["slot"]))


def _hosted_rank(slot: str) -> int:
    return int(slot[4:]) if slot.startswith("rank") and slot[4:].isdigit() else 0


def joiners(cluster) -> list[tuple[int, dict]]:
    """Engines that joined with ``python -m labkit join`` and wait to become ranks."""
    if cluster.client is None:
        return []
    return [(engine, info) for engine, info in describe(cluster, new_engines(cluster)).items()
            if info["slot"] == JOINED]


def engine_set_of(info: dict) -> str | None:
    """The launcher's engine set an engine came from ("rank3" hosted, "set:ranks2" another launcher's)."""
    slot = info["slot"]
    if slot == JOINED:
        return None
    return slot[4:] if slot.startswith("set:") else slot


def assign(cluster, found: list[tuple[int, dict]], ranks: list[int], deadline: float) -> dict[int, RankSettings]:
    """Make the engines ``found`` the ranks ``ranks`` and tell them their place; every rank's settings.

    The ranks that were already there keep their numbers; their new world size
    reaches them when the process group forms next."""
    placed = {}
    for (engine, info), rank in zip(found, ranks):
        if info.get("install_error"):
            raise StartupError(f"the engine on {info['host']} (pid {info['pid']}) could not load labkit's rank "
                               f"code:\n{info['install_error']}")
        ids = info.get("gpu_ids")
        placed[rank] = RankRecord(engine, info["pid"], info["host"], info["slot"], engine_set_of(info),
                                  info.get("gpus", 0), None if ids is None else tuple(str(gpu) for gpu in ids),
                                  info.get("launched_on"))
    records = {**cluster.records, **placed}
    world = sorted(records)
    if world != list(range(len(world))):
        raise LabError(f"the ranks are not numbered 0..{len(world) - 1}: {world}")
    # The whole world, whatever launched each rank: a joined or healed rank's GPU is its number among
    # every rank on its host, so checking the new ranks alone would let one past its host's GPUs.
    check_host_places(cluster.plan.backend, [records[rank].host for rank in world],
                      [records[rank].gpus for rank in world], cluster.plan.ranks_per_host,
                      [records[rank].gpu_ids for rank in world])
    cluster.records.update(placed)  # only a world that fits: refused engines stay unassigned
    ports = controller_ports(cluster.engine_connection())
    hosts = [cluster.records[rank].host for rank in world]
    settings = {rank: cluster.plan.settings(rank, len(world), *place, controller_ports=ports)
                for rank, place in zip(world, host_layout(hosts))}
    pending = {rank: cluster.client[cluster.records[rank].engine].apply_async(rank_entry.become_rank,
                                                                              settings[rank]) for rank in ranks}
    for rank, result in pending.items():
        try:
            result.get(max(0.1, deadline - time.monotonic()))
        except Exception as error:
            what = getattr(error, "evalue", None) or str(error) or type(error).__name__
            raise StartupError(f"rank {rank} (engine on {cluster.records[rank].host}) could not become a rank: "
                               f"{what}") from None
    return settings
