"""How failures on several ranks are grouped and told."""

from labkit.spec.errors import RankFailure, RankInterrupted


def _error(kind, error_type="ValueError", message="bad", traceback="Traceback...\nValueError: bad"):
    return {"ok": False, "error": {"kind": kind, "type": error_type, "message": message, "traceback": traceback}}


CLOSED = "[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:{port}. This is typically caused"


def test_cause_first_then_released_ranks_grouped():
    reports = {
        0: _error("collective", "RuntimeError", CLOSED.format(port=1111)),
        1: _error("raised"),
        2: _error("collective", "RuntimeError", CLOSED.format(port=2222)),
        3: {"ok": True, "value": 3},
    }
    failure = RankFailure(reports, recovery="rebuilt")
    assert failure.summary() == ("rank 1 raised ValueError: bad; ranks 0, 2 failed in a collective as a consequence "
                                 "of rank 1")
    details = failure.details()
    assert "--- rank 1 ---\nTraceback...\nValueError: bad" in details
    # Peer ports and source paths differ per rank; the grouped message drops them.
    assert ("--- ranks 0, 2 (released from a collective: a consequence of rank 1, not a cause) ---\n"
            "RuntimeError: Connection closed by peer [peer]") in details
    assert details.endswith("rebuilt")
    assert failure.failed_ranks == [0, 1, 2]
    assert str(failure) == failure.summary()
    assert failure.__notes__ == [details]


def test_identical_tracebacks_are_shown_once():
    reports = {rank: _error("raised") for rank in range(3)}
    failure = RankFailure(reports)
    assert failure.summary() == "ranks 0, 1, 2 raised ValueError: bad"
    assert failure.details().count("Traceback...") == 1


def test_summary_names_each_distinct_message_by_its_first_line():
    reports = {
        0: _error("raised", message="boom"),
        1: _error("raised", message="boom on one\nmore detail below"),
        2: _error("raised", message="\n  boom  \nsecond line"),
        3: _error("raised", "KeyError", "'boom'", "Traceback...\nKeyError: 'boom'"),
    }
    failure = RankFailure(reports)
    assert failure.summary() == (
        "ranks 0, 2 raised ValueError: boom; rank 1 raised ValueError: boom on one; rank 3 raised KeyError: 'boom'"
    )
    assert str(failure) == failure.summary()
    rendered = failure._render_traceback_()
    assert rendered[0] == f"RankFailure: {failure.summary()}"
    assert rendered[1] == "--- ranks 0, 1, 2 ---"  # the same traceback text: shown once
    assert rendered[-3:] == ["--- rank 3 ---", "Traceback...", "KeyError: 'boom'"]


def test_empty_message_keeps_the_bare_type():
    failure = RankFailure({2: _error("raised", "AssertionError", ""), 3: _error("raised", message=" \n")})
    assert failure.summary() == "rank 2 raised AssertionError; rank 3 raised ValueError"


def test_summary_stays_one_short_line():
    failure = RankFailure({0: _error("raised", message="x" * 1000 + "\ny" * 50)})
    summary = failure.summary()
    assert "\n" not in summary and "y" not in summary
    assert summary.endswith("...") and len(summary) == len("rank 0 raised ValueError: ") + 200


def test_many_distinct_messages_are_folded_into_one_part():
    reports = {rank: _error("raised", message=f"rank {rank} is out of data") for rank in range(6)}
    summary = RankFailure(reports).summary()
    assert summary.startswith("rank 0 raised ValueError: rank 0 is out of data; rank 1 raised ValueError")
    assert summary.endswith("; ranks 3, 4, 5 raised ValueError (other messages)")


def test_hung_and_replaced_ranks_are_named():
    reports = {
        0: _error("interrupted", "KeyboardInterrupt", "", 'Traceback\n  File "<lab cell 2>", line 3, in <module>'),
        1: _error("interrupted", "Unresponsive", "did not respond"),
        2: _error("died", "ProcessDied", "the rank's process exited (exit code 3)"),
    }
    failure = RankFailure(reports, timed_out=True, timeout_seconds=3, replaced=(1,))
    summary = failure.summary()
    assert "rank 2 died" in summary
    assert "ranks 0, 1 did not finish within 3 s and were interrupted" in summary
    assert "rank 1 did not respond and was replaced" in summary
    assert 'interrupted while in File "<lab cell 2>", line 3' in failure.details()


def test_interrupt_is_a_keyboard_interrupt():
    failure = RankInterrupted({0: _error("interrupted", "KeyboardInterrupt", "")}, interrupted=True)
    assert isinstance(failure, KeyboardInterrupt) and isinstance(failure, RankFailure)
    assert failure.summary() == "rank 0 interrupted"
    assert failure._render_traceback_()[0] == "RankInterrupted: rank 0 interrupted"


KILLED = ("the rank's process exited (SIGKILL (exit code -9): killed: by someone (kill -9, %lab kill) or by the "
          "kernel's out-of-memory killer)")


def test_ranks_that_died_the_same_way_are_explained_once_and_their_peers_are_consequences():
    reports = {
        0: _error("collective", "RuntimeError", CLOSED.format(port=1111)),
        1: _error("died", "ProcessDied", KILLED),
        2: _error("died", "ProcessDied", KILLED),
        # Raised where the rank's code did not see a collective: still only the echo of a peer's death.
        3: _error("raised", "RuntimeError", "Connection closed by peer [127.0.0.1]:4444"),
    }
    failure = RankFailure(reports)
    assert failure.summary() == ("ranks 1, 2 died (process exited); ranks 0, 3 failed in a collective as a "
                                 "consequence of ranks 1, 2")
    details = failure.details()
    assert details.count("out-of-memory killer") == 1
    assert f"--- ranks 1, 2 (died) ---\n{KILLED}" in details
    assert ("--- ranks 0, 3 (released from a collective: a consequence of ranks 1, 2, not a cause) ---\n"
            "RuntimeError: Connection closed by peer [peer]") in details
    assert failure.causes == [1, 2] and list(failure.released) == [0, 3] and not failure.raised


def test_a_connection_error_alone_is_still_told_as_raised():
    failure = RankFailure({0: _error("raised", "RuntimeError", "Connection reset by peer"), 1: {"ok": True}})
    assert failure.summary() == "rank 0 raised RuntimeError: Connection reset by peer"


# -- what one rank reports of an error (rank.failures) ------------------------------------------------


def test_a_rank_tells_its_own_failure_from_one_a_peer_caused():
    from labkit.rank.failures import classify_error

    assert classify_error(KeyboardInterrupt()) == "interrupted"
    assert classify_error(RuntimeError(CLOSED.format(port=1111))) == "collective"
    assert classify_error(ValueError("bad")) == "raised"
    # Only an error of the distributed stack is a peer's echo: the same words from user code are its own.
    assert classify_error(ConnectionError("Connection closed by peer")) == "raised"


def test_a_rank_that_torchs_collective_checker_left_waiting_failed_because_of_its_peers():
    from labkit.rank.failures import classify_error

    # check_collectives: the checker's meeting before the collective, which the peers never came to.
    assert classify_error(RuntimeError("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 60000 ms")) == \
        "collective"


def test_a_rank_report_starts_at_the_users_code_and_says_what_to_do():
    from labkit.rank.failures import error_info

    cell: dict = {}
    exec(compile("def use():\n    return undefined_name\n", "<lab cell In[7]>", "exec"), cell)
    try:
        cell["use"]()
    except NameError as error:
        info = error_info(error, own_files={__file__})
    assert info["type"] == "NameError" and info["kind"] == "raised" and "undefined_name" in info["message"]
    assert info["traceback"].startswith('Traceback (most recent call last):\n  File "<lab cell In[7]>", line 2')
    assert __file__ not in info["traceback"]  # the lab's own frames above the user's code are left out
    assert "Hint: each rank has its own namespace" in info["traceback"]


def test_ranks_calling_different_collectives_are_named_in_the_hint():
    from labkit.rank.failures import hint

    said = hint(RuntimeError("Detected mismatch between collectives on ranks. Rank 1 is running collective: "
                             "CollectiveFingerPrint(SequenceNumber=4, OpType=ALLREDUCE, TensorShape=[8], "
                             "TensorDtypes=Float"))
    assert said == ("Hint: the ranks called different collectives at the same point: rank 1 calls allreduce of "
                    "shape [8] (float), its collective number 4.\n")
    assert hint(ValueError("bad")) == ""
