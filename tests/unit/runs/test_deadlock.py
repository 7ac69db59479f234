"""``runs.deadlock``'s rules over made-up rank states, and how a deadlock is told. No processes.

States are what ``rank.whereabouts`` publishes (groups as ``LabGroups.state()`` gives
them); reports are the runtime's, with the groups at the end of the work.
"""

from labkit.runs.deadlock import (
    DeadlockWatch,
    describe_whereabouts,
    find_deadlock,
    in_flight,
    waiting_note,
)
from labkit.spec.errors import RankFailure
from labkit.views.rank_output import LiveOutput, RankTexts

NOW = 50.0  # the notebook's monotonic clock
SAMPLED = 1000.0  # the ranks' wall clock at their samples


def group(ranks, collectives, in_flight=(), waiting=None, issued=None):
    return {"ranks": list(ranks), "issued": collectives if issued is None else issued, "collectives": collectives,
            "in_flight": [list(entry) for entry in in_flight], "waiting": waiting}


def state(groups, line=4, text="dist.all_reduce(x)", seen_at=NOW):
    return {"work": "w", "world": "0", "groups": groups, "sampled": SAMPLED, "seen_at": seen_at,
            "where": {"file": "<lab cell In[7]>", "line": line, "text": text}}


def waiting_in(kind, number, members=(0, 1), name="0", since=SAMPLED - 1.5, nbytes=4):
    return {name: group(members, number, [(number, kind, nbytes, since)], waiting=number)}


def finished(groups, ok=True):
    report = {"ok": ok, "groups": groups}
    if not ok:
        report["error"] = {"type": "NameError", "message": "x", "traceback": "", "kind": "raised"}
    return report


def test_a_rank_waits_in_a_collective_a_finished_rank_never_issued():
    found = find_deadlock({0: state(waiting_in("all_reduce", 3))}, {1: finished({"0": group((0, 1), 2)})},
                          work_ranks=[0, 1], now=NOW)
    assert found.rule == "never joined"
    assert found.headline == ("deadlock: rank 0 waits in all_reduce on the world group (ranks 0, 1), which rank 1 "
                              "will never join")
    assert found.lines == [
        "rank 0 waits in all_reduce (collective 3 of the world group (ranks 0, 1)) at line 4 (`dist.all_reduce(x)`) "
        "for 1.5 s",
        "rank 1 finished the cell having issued 2 collectives on the world group (ranks 0, 1)",
    ]
    assert found.groups == {"0"}


def test_a_finished_rank_that_issued_as_many_is_no_deadlock_however_late_the_sample():
    # rank 0's sample lags: the all-reduce it shows in flight has in fact met rank 1's.
    assert find_deadlock({0: state(waiting_in("all_reduce", 3))}, {1: finished({"0": group((0, 1), 3)})},
                         work_ranks=[0, 1], now=NOW) is None


def test_a_failed_rank_and_a_ddp_backward_with_its_bucket_in_flight():
    # DDP waits on its buckets' futures in C++: in flight, not waited in Python.
    busy = {"0": group((0, 1), 5, [(5, "all_reduce", 400, SAMPLED - 0.5)])}
    found = find_deadlock({0: state(busy, text="loss.backward()")}, {1: finished({"0": group((0, 1), 4)}, ok=False)},
                          work_ranks=[0, 1], now=NOW)
    assert "rank 0 has in flight all_reduce" in found.lines[0] and "`loss.backward()`" in found.lines[0]
    assert found.lines[1] == "rank 1 stopped with NameError having issued 4 collectives on the world group (ranks 0, 1)"


def test_a_receive_from_a_stage_that_stopped_with_an_error_is_left_waiting():
    # A pipeline: rank 1's loss raised; rank 0 waits for the gradient rank 1 would have sent back.
    receiving = {"1": group((0, 1), 2, [(7, "recv", 64, SAMPLED - 2)], waiting=7, issued=7)}
    stage = state(receiving, text="self.schedule.step(*inputs)")
    found = find_deadlock({0: stage}, {1: finished({"1": group((0, 1), 2, issued=6)}, ok=False)}, work_ranks=[0, 1],
                          now=NOW)
    assert found.rule == "left waiting" and found.groups == {"1"}
    assert found.headline == "rank 1 stopped with an error, and rank 0 waits in a send or receive it will never answer"
    assert found.lines == ["rank 0 waits in recv on group '1' (ranks 0, 1) at line 4 (`self.schedule.step(*inputs)`)"]
    # The same receive while its peer finished well, or still runs, is waited for as usual.
    assert find_deadlock({0: stage}, {1: finished({"1": group((0, 1), 2, issued=6)})}, now=NOW) is None
    assert find_deadlock({0: stage, 1: state({"1": group((0, 1), 2, issued=6)})}, {}, now=NOW) is None


def test_ranks_not_in_the_cell_never_join_and_unknown_ones_are_never_blamed():
    waiting = {0: state(waiting_in("all_reduce", 2, members=(0, 1, 2, 3)))}
    idle = {rank: {"0": group((0, 1, 2, 3), 1)} for rank in (1, 2, 3)}
    found = find_deadlock(waiting, {}, idle, work_ranks=[0], now=NOW)
    assert "which ranks 1, 2, 3 will never join" in found.headline
    assert found.lines[-1] == "ranks 1, 2, 3 are not in this cell (it runs on rank 0 only)"
    assert find_deadlock(waiting, {}, {}, work_ranks=[0], now=NOW) is None


def test_different_kinds_at_one_collective_number_are_a_mismatch():
    states = {0: state(waiting_in("broadcast", 3), text="dist.broadcast(x, 0)"), 1: state(waiting_in("all_reduce", 3))}
    found = find_deadlock(states, {}, work_ranks=[0, 1], now=NOW)
    assert found.rule == "mismatch"
    assert found.headline == ("deadlock: the ranks called different collectives as collective 3 of the world group "
                              "(ranks 0, 1): rank 0 broadcast (4 bytes), rank 1 all_reduce (4 bytes)")
    assert "`dist.broadcast(x, 0)`" in found.lines[0]


def test_sizes_differ_as_a_mismatch_only_where_every_member_has_the_same_size():
    sizes = {0: state(waiting_in("all_reduce", 3, nbytes=40)), 1: state(waiting_in("all_reduce", 3, nbytes=80))}
    assert find_deadlock(sizes, {}, now=NOW).rule == "mismatch"
    uneven = {0: state(waiting_in("all_to_all", 3, nbytes=40)), 1: state(waiting_in("all_to_all", 3, nbytes=80))}
    assert find_deadlock(uneven, {}, now=NOW) is None


def test_calls_torchs_collective_checker_holds_are_not_compared_and_a_rank_that_never_came_is_named():
    # check_collectives: the checker holds each call until every member made it, and names a mismatch itself.
    def held(nbytes):
        groups = waiting_in("all_reduce", 3, nbytes=nbytes)
        groups["0"]["entering"] = 3
        return state(groups)

    assert find_deadlock({0: held(40), 1: held(80)}, {}, now=NOW) is None
    found = find_deadlock({0: held(40)}, {1: finished({"0": group((0, 1), 2)})}, work_ranks=[0, 1], now=NOW)
    assert found.rule == "never joined" and found.lines[0].startswith("rank 0 waits in all_reduce (collective 3")


def test_sends_and_receives_after_a_collective_blur_its_number_and_nothing_is_compared():
    # Two operations completed after the all-reduce: sends or collectives, nobody knows.
    blurred = {"0": group((0, 1), 3, [(3, "all_reduce", 4, SAMPLED)], issued=5)}
    [item] = in_flight(0, blurred)
    assert item.number is None and item.at_least == 1
    clear = {"0": group((0, 1), 3, [(3, "broadcast", 4, SAMPLED)])}
    assert find_deadlock({0: state(blurred), 1: state(clear)}, {}, now=NOW) is None


def test_every_rank_blocked_where_no_collective_can_complete_holds_over_two_reads():
    cycle = {
        0: state({"a": group((0, 1), 1, [(1, "all_reduce", 4, SAMPLED - 1)], waiting=1), "b": group((0, 2), 0)}),
        1: state({"a": group((0, 1), 0), "c": group((1, 2), 1, [(1, "all_reduce", 4, SAMPLED - 1)], waiting=1)}),
        2: state({"b": group((0, 2), 1, [(1, "all_reduce", 4, SAMPLED - 1)], waiting=1), "c": group((1, 2), 0)}),
    }
    watch = DeadlockWatch()
    assert watch.check(cycle, {}, {}, [0, 1, 2], [0, 1, 2], NOW, rounds=1) is None
    assert watch.check(cycle, {}, {}, [0, 1, 2], [0, 1, 2], NOW + 0.6, rounds=2) is None  # one read only
    found = watch.check(cycle, {}, {}, [0, 1, 2], [0, 1, 2], NOW + 0.7, rounds=3)
    assert found.rule == "all blocked" and found.groups == {"a", "b", "c"}
    assert found.lines[0].endswith("; not there: rank 1")


def test_blocked_ranks_whose_collective_has_every_member_are_slow_not_stuck():
    arrived = {rank: state(waiting_in("all_reduce", 2)) for rank in (0, 1)}
    watch = DeadlockWatch(stranded_seconds=0.0)
    for step in range(4):
        assert watch.check(arrived, {}, {}, [0, 1], [0, 1], NOW + step, rounds=step) is None


def test_a_rank_that_computes_while_another_waits_is_no_deadlock():
    computing = {0: state(waiting_in("all_reduce", 2)), 1: state({"0": group((0, 1), 1)}, text="time.sleep(5)")}
    watch = DeadlockWatch()
    for step in range(5):
        assert watch.check(computing, {}, {}, [0, 1], [0, 1], NOW + step, rounds=step) is None


def test_a_rank_stranded_in_a_collective_every_other_member_completed():
    # rank 0 broadcast as collective 3 and finished; rank 1 still waits in its all-reduce 3.
    states = {1: state(waiting_in("all_reduce", 3))}
    done = {0: finished({"0": group((0, 1), 3)})}
    watch = DeadlockWatch()
    assert watch.check(states, done, {}, [0, 1], [1], NOW, rounds=1) is None
    assert watch.check(states, done, {}, [0, 1], [1], NOW + 2, rounds=5) is None
    found = watch.check(states, done, {}, [0, 1], [1], NOW + 3.1, rounds=9)
    assert found.rule == "stranded" and "which rank 0 completed" in found.headline


def test_a_typo_on_every_rank_with_one_rank_late_is_no_deadlock():
    late = {1: state({"0": group((0, 1), 4)}, text="time.sleep(1.5)")}
    raised = {0: finished({"0": group((0, 1), 4)}, ok=False)}
    watch = DeadlockWatch()
    for step in range(6):
        assert watch.check(late, raised, {}, [0, 1], [1], NOW + step, rounds=step) is None


def test_where_a_busy_rank_is_and_the_live_line_after_three_seconds():
    short = {1: state(waiting_in("all_reduce", 3, since=SAMPLED - 1.0))}
    assert waiting_note(short, NOW) == ""
    long = {1: state(waiting_in("all_reduce", 3, since=SAMPLED - 3.0), line=4), 0: state(waiting_in("all_reduce", 3))}
    assert waiting_note(long, NOW + 0.2) == ("rank 1 waits in all_reduce on the world group at line 4 "
                                             "(`dist.all_reduce(x)`) for 3.2 s")
    assert describe_whereabouts(1, long[1], NOW + 0.2) == (
        "at line 4 (`dist.all_reduce(x)`), waiting in all_reduce on the world group (ranks 0, 1) for 3.2 s")
    sleeping = state({"0": group((0, 1), 1)}, line=2, text="time.sleep(5)")
    assert describe_whereabouts(0, sleeping, NOW) == "at line 2 (`time.sleep(5)`)"


def test_the_live_line_is_printed_once_in_a_terminal(capsys):
    output = LiveOutput(RankTexts([0, 1]), live=False)
    for seconds in (3.1, 3.3, 3.5):
        output.note(f"rank 1 waits in all_reduce on the world group at line 4 for {seconds} s")
    output.finish()
    assert capsys.readouterr().err.count("labkit: rank 1 waits") == 1


def test_the_failure_tells_the_deadlock_first():
    reports = {0: {"rank": 0, "ok": False, "error": {"type": "DistNetworkError", "kind": "collective",
                                                     "message": "Connection closed by peer", "traceback": ""}},
               1: {"rank": 1, "ok": True}}
    deadlock = "deadlock: rank 0 waits in all_reduce on the world group (ranks 0, 1), which rank 1 will never join\n" \
               "  rank 0 waits in all_reduce ... at line 3 (`dist.all_reduce(t)`) for 0.4 s"
    failure = RankFailure(reports, deadlock=deadlock)
    assert str(failure).startswith("deadlock: rank 0 waits in all_reduce on the world group")
    assert failure.details().startswith("  rank 0 waits in all_reduce ... at line 3")
    assert not RankFailure(reports).deadlock
