"""Naming a deadlock among the ranks of one piece of work, from what each rank issued on each group.

Pure logic over plain dicts (no ranks, no store):

- ``states``: rank -> the latest whereabouts of a rank still running the work
  (``rank.whereabouts``: ``groups`` as ``LabGroups.state()`` gives them, ``where``,
  ``world``, ``sampled``), with ``seen_at``, the notebook's ``time.monotonic()``
  when that sample was read;
- ``finished``: rank -> the report of a rank that finished the work (its groups at its end);
- ``absent``: rank -> the groups of a rank that is not in the work (None: not known).

Collectives are compared by number: the k-th collective a group issued is the same
collective on every member (sends and receives are not counted: they are a pair's).
Counts only grow, and a rank's number for a collective is never over-estimated, so
a sample that lags behind cannot raise a false alarm:

1. never joined: a rank has collective k of group G in flight (or waits in it), and a
   member of G that finished, or is not in the work, issued fewer than k on G;
2. mismatch: members have collective k of G in flight as different kinds (or sizes,
   where every member's size is the same); not while torch's collective checker holds the
   calls (``entering``): it names the mismatch itself;
3. all blocked: every running rank waits in a collective, and in none of them have
   all members arrived; held over two reads at least ``BLOCKED_SECONDS`` apart;
4. stranded: a rank waits in collective k of G that every other member completed (they
   called another collective, or another size, there); held ``STRANDED_SECONDS``;
5. left waiting: a rank waits in a send or receive on G, and a member of G stopped with an
   error (a pipeline stage whose loss raised): nothing will answer it.

Rules 1, 2 and 5 hold at once; ``DeadlockWatch`` holds 3 and 4 until they last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.spec.errors import format_ranks

BLOCKED_SECONDS = 0.5
# Every other member completed it: only data already sent is missing, which takes milliseconds.
STRANDED_SECONDS = 3.0
POINT_TO_POINT = frozenset({"send", "recv"})
# Kinds whose bytes (as timed_group counts them) are the same on every member; all_to_all's are not.
SAME_SIZE = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "barrier"})


@dataclass(frozen=True)
class InFlight:
    """One collective a rank issued that has not completed."""

    rank: int
    group: str
    members: tuple[int, ...]
    sequence: int  # the group's count of every operation, on this rank
    number: int | None  # which collective of the group it is; None when sends or receives blur it
    at_least: int  # a number it is certainly not below
    kind: str
    nbytes: int
    since: float  # the rank's time.time() when it was issued
    waited: bool  # the rank's thread waits for it
    entering: bool = False  # its call has not answered: torch's collective checker holds it until all members come


@dataclass
class Deadlock:
    """What deadlocked, in words, and who is in it."""

    rule: str  # never joined | mismatch | all blocked | stranded | left waiting
    headline: str
    lines: list[str]
    groups: set[str] = field(default_factory=set)  # the groups whose collectives cannot complete
    signature: frozenset = frozenset()  # the same deadlock seen again has the same signature

    @property
    def text(self) -> str:
        return "\n".join([self.headline, *(f"  {line}" for line in self.lines)])


def in_flight(rank: int, groups: dict | None) -> list[InFlight]:
    """The collectives ``rank`` has in flight, from its groups' state."""
    found = []
    for name, group in (groups or {}).items():
        entries = sorted(group.get("in_flight") or [])
        for index, (sequence, kind, nbytes, since) in enumerate(entries):
            if kind in POINT_TO_POINT:
                continue
            later = entries[index + 1:]
            later_collectives = sum(1 for entry in later if entry[1] not in POINT_TO_POINT)
            completed_later = group["issued"] - sequence - len(later)  # their kinds are not known
            at_least = group["collectives"] - later_collectives - completed_later
            found.append(InFlight(rank, name, tuple(group["ranks"]), sequence,
                                  at_least if completed_later == 0 else None, at_least, kind, nbytes, since,
                                  group.get("waiting") == sequence, group.get("entering") == sequence))
    return found


def _count(rank: int, group: str, states: dict, finished: dict, absent: dict) -> int | None:
    """How many collectives ``rank`` issued on ``group`` (None: not known)."""
    if rank in states:
        groups = states[rank].get("groups")
    elif rank in finished:
        groups = finished[rank].get("groups")
    else:
        groups = absent.get(rank)
    entry = (groups or {}).get(group)
    return None if entry is None else entry["collectives"]


def _waited(state: dict, item: InFlight, now: float) -> float:
    """Seconds ``item`` has been in flight: on the rank's clock at its sample, plus the sample's age here."""
    return max(0.0, state.get("sampled", item.since) - item.since + now - state.get("seen_at", now))


def describe_group(name: str, members, world: str | None) -> str:
    label = "the world group" if name == world else f"group {name!r}"
    return f"{label} ({format_ranks(members)})"


def describe_line(where: dict | None) -> str:
    """'at line 4 (`dist.all_reduce(x)`)', with the file when it is a script's."""
    if not where:
        return "outside the cell's code"
    text = f"at line {where['line']}" + (f" (`{where['text']}`)" if where.get("text") else "")
    return text if where["file"].startswith("<") else f"{text} of {where['file']}"


def describe_rank(state: dict, item: InFlight, now: float, world: str | None) -> str:
    """'rank 0 waits in all_reduce (collective 3 of the world group (ranks 0, 1)) at line 4 (...) for 1.2 s'."""
    number = item.number if item.number is not None else f"{item.at_least} or later"
    what = f"{item.kind} (collective {number} of {describe_group(item.group, item.members, world)})"
    verb = "waits in" if item.waited else "has in flight"
    return f"rank {item.rank} {verb} {what} {describe_line(state.get('where'))} for {_waited(state, item, now):.1f} s"


def _world(states: dict) -> str | None:
    return next((state.get("world") for state in states.values() if state.get("world") is not None), None)


def _outcome(report: dict) -> str:
    if report.get("ok"):
        return "finished the cell"
    return f"stopped with {report.get('error', {}).get('type', 'an error')}"


def never_joined(states: dict, finished: dict, absent: dict, work_ranks, now: float) -> Deadlock | None:
    """Rule 1: collectives a member that is done (or not in the work) will never issue."""
    world = _world(states)
    stuck: dict[tuple[str, int], dict[InFlight, dict]] = {}  # (group, number) -> {collective: its rank's state}
    missing: dict[tuple[str, int], dict[int, int]] = {}  # (group, number) -> {member: its count}
    for rank, state in sorted(states.items()):
        for item in in_flight(rank, state.get("groups")):
            for member in item.members:
                if member == rank or member in states:
                    continue  # a member still running may yet join
                count = _count(member, item.group, states, finished, absent)
                if count is not None and count < item.at_least:
                    key = (item.group, item.at_least)
                    stuck.setdefault(key, {})[item] = state
                    missing.setdefault(key, {})[member] = count
    if not stuck:
        return None
    group, number = min(stuck)
    waiting = [(state, item) for item, state in stuck[(group, number)].items()]
    item = waiting[0][1]
    left = missing[(group, number)]
    where = describe_group(group, item.members, world)
    headline = (f"deadlock: {format_ranks(sorted({i.rank for _, i in waiting}))} "
                f"wait{'s' if len(waiting) == 1 else ''} in {item.kind} on {where}, which "
                f"{format_ranks(left)} will never join")
    lines = [describe_rank(state, i, now, world) for state, i in waiting]
    done = sorted(rank for rank in left if rank in finished)
    for rank in done:
        lines.append(f"rank {rank} {_outcome(finished[rank])} having issued {left[rank]} collective"
                     f"{'s' if left[rank] != 1 else ''} on {where}")
    not_in = sorted(rank for rank in left if rank not in finished)
    if not_in:
        lines.append(f"{format_ranks(not_in)} {'is' if len(not_in) == 1 else 'are'} not in this cell "
                     f"(it runs on {format_ranks(work_ranks)} only)")
    return Deadlock("never joined", headline, lines, {g for g, _ in stuck},
                    frozenset((i.rank, i.group, i.sequence) for items in stuck.values() for i in items))


def mismatched(states: dict, finished: dict, now: float) -> Deadlock | None:
    """Rule 2: one collective number, different kinds (or sizes)."""
    world = _world(states)
    by_number: dict[tuple[str, int], list] = {}
    sources = [(rank, state, state.get("groups")) for rank, state in states.items()]
    sources += [(rank, {}, report.get("groups")) for rank, report in finished.items()]
    for rank, state, groups in sorted(sources, key=lambda source: source[0]):
        for item in in_flight(rank, groups):
            # A call the checker holds: it names a mismatch itself, with each rank's shapes.
            if item.number is not None and not item.entering:
                by_number.setdefault((item.group, item.number), []).append((state, item))
    for (group, number), calls in sorted(by_number.items()):
        kinds = {item.kind for _, item in calls}
        sizes = {item.nbytes for _, item in calls}
        if len(kinds) == 1 and (len(sizes) == 1 or next(iter(kinds)) not in SAME_SIZE):
            continue
        item = calls[0][1]
        said = ", ".join(f"rank {i.rank} {i.kind} ({i.nbytes} bytes)" for _, i in calls)
        headline = (f"deadlock: the ranks called different collectives as collective {number} of "
                    f"{describe_group(group, item.members, world)}: {said}")
        lines = [describe_rank(state, i, now, world) if state else f"rank {i.rank} finished with {i.kind} in flight"
                 for state, i in calls]
        return Deadlock("mismatch", headline, lines, {group},
                        frozenset((i.rank, group, i.sequence) for _, i in calls))
    return None


def all_blocked(states: dict, finished: dict, absent: dict, pending, now: float) -> Deadlock | None:
    """Rule 3 (a candidate): every running rank waits, and no collective waited in has all its members."""
    if not pending or set(pending) - set(states):
        return None
    world = _world(states)
    waits: list[tuple[InFlight, int]] = []  # (the collective each rank waits in first, its number)
    for rank in sorted(pending):
        waited = [item for item in in_flight(rank, states[rank].get("groups")) if item.waited]
        first = waited[0] if waited else None
        if first is None or first.number is None:
            return None  # computing, in a send or receive, or a collective whose number is blurred
        waits.append((first, first.number))
    lines = []
    for item, number in waits:
        counts = {member: _count(member, item.group, states, finished, absent) for member in item.members}
        if all(count is None or count >= number for count in counts.values()):
            return None  # all arrived: slow, not stuck (or stranded: rule 4)
        lines.append(describe_rank(states[item.rank], item, now, world) + "; not there: " + format_ranks(
            sorted(member for member, count in counts.items() if count is not None and count < number)))
    headline = f"deadlock: every rank of the cell waits in a collective that cannot complete ({len(waits)} ranks)"
    return Deadlock("all blocked", headline, lines, {item.group for item, _ in waits},
                    frozenset((item.rank, item.group, item.sequence) for item, _ in waits))


def stranded(states: dict, finished: dict, absent: dict, now: float) -> Deadlock | None:
    """Rule 4 (a candidate): a rank waits in a collective every other member completed."""
    world = _world(states)
    for rank, state in sorted(states.items()):
        for item in in_flight(rank, state.get("groups")):
            if not item.waited or item.number is None:
                continue
            others = [member for member in item.members if member != rank]
            if not others or not all(_completed(member, item, item.number, states, finished, absent)
                                     for member in others):
                continue
            headline = (f"deadlock: rank {rank} waits in {item.kind} as collective {item.number} of "
                        f"{describe_group(item.group, item.members, world)}, which {format_ranks(others)} "
                        "completed: they called a different collective (or other sizes) there")
            return Deadlock("stranded", headline, [describe_rank(state, item, now, world)], {item.group},
                            frozenset({(rank, item.group, item.sequence)}))
    return None


def _completed(member: int, item: InFlight, number: int, states: dict, finished: dict, absent: dict) -> bool:
    """Whether ``member`` completed ``item``, collective ``number`` of its group."""
    count = _count(member, item.group, states, finished, absent)
    if count is None or count < number:
        return False
    groups = states[member].get("groups") if member in states else (
        finished[member].get("groups") if member in finished else absent.get(member))
    return all(other.at_least > number for other in in_flight(member, groups) if other.group == item.group)


def transfers_waited(rank: int, groups: dict | None) -> list[tuple[str, tuple[int, ...], str]]:
    """(group, members, kind) of each send or receive ``rank``'s thread waits in."""
    found = []
    for name, group in (groups or {}).items():
        waiting = group.get("waiting")
        for sequence, kind, _, _ in group.get("in_flight") or []:
            if sequence == waiting and kind in POINT_TO_POINT:
                found.append((name, tuple(group["ranks"]), kind))
    return found


def left_waiting(states: dict, finished: dict) -> Deadlock | None:
    """Rule 5: a rank waits in a send or receive on a group a member of which stopped with an error (a
    pipeline stage whose loss raised): what it waits for will never come, and sends and receives are not
    counted, so rule 1 cannot see it."""
    failed = {rank for rank, report in finished.items() if not report.get("ok")}
    waits = [(rank, name, members, kind) for rank, state in sorted(states.items())
             for name, members, kind in transfers_waited(rank, state.get("groups")) if failed & set(members)]
    if not failed or not waits:
        return None
    world = _world(states)
    stopped = sorted(failed & {member for _, _, members, _ in waits for member in members})
    headline = (f"{format_ranks(stopped)} stopped with an error, and {format_ranks(sorted({w[0] for w in waits}))} "
                f"wait{'s' if len(waits) == 1 else ''} in a send or receive it will never answer")
    lines = [f"rank {rank} waits in {kind} on {describe_group(name, members, world)} "
             f"{describe_line(states[rank].get('where'))}" for rank, name, members, kind in waits]
    return Deadlock("left waiting", headline, lines, {name for _, name, _, _ in waits},
                    frozenset((rank, name) for rank, name, _, _ in waits))


def find_deadlock(states: dict, finished: dict, absent: dict | None = None, work_ranks=(), now: float = 0.0):
    """The deadlock rules 1, 2 and 5 name at once, or None."""
    absent = absent or {}
    return (never_joined(states, finished, absent, work_ranks, now) or mismatched(states, finished, now)
            or left_waiting(states, finished))


class DeadlockWatch:
    """Rules 1 to 4 over successive reads; ``check`` returns a ``Deadlock`` once one holds."""

    def __init__(self, blocked_seconds: float = BLOCKED_SECONDS, stranded_seconds: float = STRANDED_SECONDS):
        self.hold = {"all blocked": blocked_seconds, "stranded": stranded_seconds}
        self._first_seen: dict[frozenset, tuple[float, int]] = {}  # signature -> (when, read round)

    def check(self, states: dict, finished: dict, absent: dict | None, work_ranks, pending, now: float,
              rounds: int) -> Deadlock | None:
        """``pending``: the ranks still running; ``rounds``: the reader's count of complete reads."""
        absent = absent or {}
        found = find_deadlock(states, finished, absent, work_ranks, now)
        if found is not None:
            return found
        candidates = [c for c in (all_blocked(states, finished, absent, pending, now),
                                  stranded(states, finished, absent, now)) if c is not None]
        seen = {}
        for candidate in candidates:
            when, round_seen = self._first_seen.get(candidate.signature, (now, rounds))
            seen[candidate.signature] = (when, round_seen)
            # Two reads apart (not the same read looked at twice), and long enough for any lag to show.
            if now - when >= self.hold[candidate.rule] and rounds >= round_seen + 2:
                return candidate
        self._first_seen = seen
        return None


# -- where busy ranks are, in words (lab.status, the live line under a cell) ---------------------------


def waits_of(rank: int, state: dict, now: float) -> list[tuple[float, InFlight]]:
    """(seconds waited, collective) for each collective ``rank``'s thread waits in."""
    return [(_waited(state, item, now), item) for item in in_flight(rank, state.get("groups")) if item.waited]


def describe_whereabouts(rank: int, state: dict, now: float) -> str:
    """'at line 4 (`dist.all_reduce(x)`), waiting in all_reduce on the world group for 3.2 s'."""
    text = describe_line(state.get("where"))
    for seconds, item in waits_of(rank, state, now):
        label = describe_group(item.group, item.members, state.get("world"))
        text += f", waiting in {item.kind} on {label} for {seconds:.1f} s"
    return text


def waiting_note(states: dict, now: float, at_least: float = 3.0) -> str:
    """One line about the rank that has waited longest in one collective, past ``at_least`` seconds ('' if none)."""
    waits = sorted(((seconds, rank, item) for rank, state in states.items()
                    for seconds, item in waits_of(rank, state, now) if seconds >= at_least), reverse=True)
    if not waits:
        return ""
    seconds, rank, item = waits[0]
    state = states[rank]
    label = "the world group" if item.group == state.get("world") else f"group {item.group!r}"
    note = f"rank {rank} waits in {item.kind} on {label} {describe_line(state.get('where'))} for {seconds:.1f} s"
    others = len({other for _, other, _ in waits}) - 1
    return note + (f" (and {others} more rank{'s' if others > 1 else ''})" if others else "")
