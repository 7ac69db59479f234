"""After failed work: what the lab does to its process groups, and what it tells the user.

``Session.failure`` calls ``recover`` before it raises the failure. Three outcomes:

- a rank died, froze or was replaced: the ranks form the world anew; everything built
  on the groups of before fails at once, saying why, on every rank;
- a collective was cut (a peer raised or was interrupted while others waited in it,
  or waiting peers were released) or the ranks left one out of step: every group is
  rebuilt in place, and the DDP, FSDP and TP models, meshes and groups built on them
  go on;
- nothing was disturbed (a typo on every rank, an interrupt between collectives): the
  groups stay as they are, and nothing is said about them beyond that.

In the last two, every rank then puts its DDP and FSDP2 models' per-iteration state back
in step (``rank.model_steps``), the same way on each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.spec.errors import LabError, format_ranks
from labkit.wire.schema import FailureKind, RankReport

if TYPE_CHECKING:  # for annotations only: the session is a layer above, and this needs no work running
    from labkit.runs.dispatch import RankWork
    from labkit.session import Session


def with_kept_logs(cluster, broken: dict[int, str], replaced: list[int]) -> dict[int, str]:
    """``broken``'s reasons, each rank that exited and is replaced with where its log is kept now (``rank_logs``)."""
    from labkit.cluster.rank_logs import keep_rank_log

    logs = {rank: keep_rank_log(cluster, rank) for rank in replaced if broken[rank].startswith("exited")}
    return {rank: reason + (f" (its log: {logs[rank]})" if logs.get(rank) else "") for rank, reason in broken.items()}


def split_broken(cluster, broken) -> tuple[list[int], list[int], dict[int, str]]:
    """The ``broken`` ranks a repair drops (joined from elsewhere, or on a host ssh no longer reaches: those
    with why), and those it replaces with fresh processes."""
    from labkit.cluster.ssh_reach import unreachable_ranks

    joined = {rank for rank in broken if cluster.records[rank].joined}
    cut_off = unreachable_ranks(cluster, set(broken) - joined)
    dropped = sorted(joined | set(cut_off))
    return dropped, sorted(set(broken) - set(dropped)), cut_off


def dropped_notes(dropped: list[int], cut_off: dict[int, str]) -> list[str]:
    """What a repair says of the ranks it dropped (see ``split_broken``)."""
    joined = [rank for rank in dropped if rank not in cut_off]
    notes = []
    if joined:
        notes.append(f"dropped {format_ranks(joined)}, which joined from another machine and cannot be restarted "
                     "from here")
    if cut_off:
        notes.append(f"dropped {format_ranks(sorted(cut_off))}: {'; '.join(sorted(set(cut_off.values())))}, so "
                     "nothing can be started again there")
    if notes:
        notes[-1] += "; the ranks after them were renumbered"
    return notes


def stale_reason(generation: int, replaced=(), dropped=(), joined: int = 0) -> str:
    """What a process group of ``generation`` says when used after the ranks changed."""
    changes = []
    if replaced:
        changes.append(f"{format_ranks(replaced)} {'was' if len(replaced) == 1 else 'were'} replaced by fresh "
                       f"{'process' if len(replaced) == 1 else 'processes'}")
    if dropped:
        changes.append(f"{format_ranks(dropped)} (joined from another machine) {'was' if len(dropped) == 1 else 'were'} "
                       "dropped")
    if joined:
        changes.append(f"{joined} rank(s) joined")
    return (f"this process group belongs to the lab as it was before {' and '.join(changes) or 'its ranks changed'} "
            f"(generation {generation}): what was built on it (DDP, FSDP or TP models, meshes, groups) cannot be "
            "used any more; re-create it on every rank (run the cells that built it), or lab.load a checkpoint")


def unusable_note(held: dict[int, list[str]]) -> str:
    """The variables that can no longer be used (``held``: by rank, ``name (what it is)``), in words."""
    if not held:
        return ""
    by_names: dict[tuple, list[int]] = {}
    for rank, names in sorted(held.items()):
        by_names.setdefault(tuple(names), []).append(rank)
    said = "; ".join(f"on {format_ranks(ranks)}: {', '.join(names)}" for names, ranks in by_names.items())
    return (f"built on the process groups of before, these can no longer be used: {said}. Re-create them on "
            "every rank (run the cells that built them), or lab.load a checkpoint")


def recover(session: Session, work: RankWork, reports: dict[int, RankReport]) -> str:
    """After failed work: bring the lab back for the next call; say what was done.

    A rank that died or was replaced costs the objects built on the groups (every rank's: the
    groups are formed anew). Otherwise the groups are rebuilt in place only when a collective
    was cut or left the ranks out of step (``collectives_cut``), and kept as they are when not."""
    cluster = session.require_running()
    dead = {rank: reason for rank in cluster.ranks if (reason := cluster.condition(rank)) is not None}
    dropped = [rank for rank in dead if cluster.records[rank].joined]
    replaced = sorted((set(dead) - set(dropped)) | set(work.replaced))
    if dead or work.replaced:
        reason = stale_reason(session.generation, replaced, dropped)
        if dead:
            _, held = session.repair(cluster, dead, [], reason)
        else:
            held = session.form_group(reason)
    else:
        cut = collectives_cut(reports, work.released)
        if not cut:
            return ("The process groups were not disturbed and are kept as they were"
                    f"{models_in_step(session, work)}; the lab is ready for the next cell.")
        try:
            session.rebuild_group()
        except LabError:
            # Some rank cannot even rejoin: start them all afresh and try once more.
            cluster.replace([rank for rank in cluster.ranks if not cluster.records[rank].joined])
            session.form_group("the lab's ranks were restarted after a failed rebuild of the process groups")
            return (f"The process groups could not be rebuilt in place ({cut}); every rank was restarted "
                    f"(generation {session.generation}) with an empty namespace; the lab is ready for the next cell.")
        return (f"The process groups were rebuilt in place (generation {session.generation}: {cut}); "
                f"everything built on them goes on{models_in_step(session, work)}; "
                "the lab is ready for the next cell.")
    note = f"The process groups were formed anew (generation {session.generation})"
    if session.mesh_spec is not None:
        note += f" with mesh {session.mesh_spec.describe()}"
    if replaced:
        note += f"; {format_ranks(replaced)} restarted with empty namespaces"
    if dropped:
        note += (f"; {format_ranks(dropped)} (joined from another machine) could not be restarted and were "
                 f"dropped: the lab now has {session.world_size} ranks")
    unusable = unusable_note(held)
    return note + (f"; {unusable}" if unusable else "") + "; the lab is ready for the next cell."


def models_in_step(session: Session, work: RankWork) -> str:
    """Every rank puts its DDP and FSDP2 models back in step (``rank.model_steps``): '' when done, else a
    note saying what failed and what to do."""
    from labkit.wire import entry  # sent by reference: the ranks have it

    ran = sorted(set(work.ranks) & set(range(session.world_size)))
    others = [rank for rank in range(session.world_size) if rank not in ran]
    done: list[str] = []
    try:
        for ranks, failed_here in ((ran, True), (others, False)):
            if ranks:
                for said in session.call(ranks, entry.put_models_in_step, (failed_here,), session.start_timeout):
                    done.extend(said)
    except LabError as error:
        return (f"; the DDP and FSDP models could not be put back in step ({str(error).splitlines()[0]}): "
                "re-create them on every rank (run the cells that built them), or lab.load a checkpoint")
    left = sorted({said.split(":")[0] for said in done if "cannot reset" in said})
    if left:
        return (f"; {', '.join(left)} (FSDP2) could not be put back in step: this torch cannot reset an FSDP "
                "iteration (it lacks FSDPModule.reset_iter_state): re-create it on every rank, or lab.load a "
                "checkpoint")
    return ""


def collectives_cut(reports: dict, released: bool = False) -> str:
    """Why the process groups must be rebuilt after this work, in words ('' when they are intact).

    Intact: no rank was released from (or failed in) a collective, and on every group the members
    that reported issued the same number of collectives and have no send or receive left in flight."""
    if released:
        return "peers waiting in a collective were released"
    kinds = {report.get("error", {}).get("kind") for report in reports.values() if not report.get("ok")}
    if FailureKind.COLLECTIVE in kinds:
        return "a collective was cut"
    if FailureKind.DIED in kinds:
        return "a rank died"
    counts: dict[str, set] = {}
    for report in reports.values():
        for name, group in (report.get("groups") or {}).items():
            counts.setdefault(name, set()).add(group["collectives"])
            if any(kind in ("send", "recv") for _, kind, _, _ in group["in_flight"]):
                return f"a send or receive was left unfinished on group {name!r}"
    uneven = sorted(name for name, seen in counts.items() if len(seen) > 1)
    if uneven:
        return f"the ranks issued different numbers of collectives on group {uneven[0]!r}"
    return ""
