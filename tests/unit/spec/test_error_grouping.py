"""Ranks that fail the same way are told once, even when their texts differ in addresses, ports or ids.

The texts copy the shapes of real torch and Python errors; no ranks start.
"""

from labkit.spec.error_text import comparable, group_alike
from labkit.spec.errors import RankFailure


def _raised(error_type, message, traceback):
    return {"ok": False, "error": {"kind": "raised", "type": error_type, "message": message, "traceback": traceback}}


def _traceback(error_type, message, line=4, cell=12):
    return (
        "Traceback (most recent call last):\n"
        f'  File "<lab cell In[{cell}]>", line {line}, in <module>\n'
        "    model = FSDP(model, process_group=group)\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 1491, '
        "in _get_pg_backend\n"
        "    raise ValueError(\n"
        f"{error_type}: {message}\n"
    )


ADDRESSES = ["0x7f3a2c1b5e30", "0x7f9d04a8c1f0", "0x7fe1b2d3e4a0", "0x7f0c55aa9b10"]
NOT_IN_MAP = ("Process group <torch.distributed.distributed_c10d.ProcessGroup object at {address}> is not initialized "
              "in the world group map. Please initialize the group first.")


def test_fsdp_errors_that_differ_only_in_the_group_address_are_told_once_with_the_lowest_ranks_text():
    reports = {}
    for rank, address in enumerate(ADDRESSES):
        message = NOT_IN_MAP.format(address=address)
        reports[rank] = _raised("ValueError", message, _traceback("ValueError", message))
    failure = RankFailure(reports)
    assert failure.summary() == f"ranks 0, 1, 2, 3 raised ValueError: {NOT_IN_MAP.format(address=ADDRESSES[0])}"
    details = failure.details()
    assert details.count("Traceback (most recent call last)") == 1
    # One real instance (rank 0's), not a text with placeholders; the header says the others were alike.
    assert details.startswith(
        "--- ranks 0, 1, 2, 3 (rank 0's shown; the others differ only in addresses, ports, ids and such) ---\n")
    assert ADDRESSES[0] in details and not any(address in details for address in ADDRESSES[1:])
    assert "0x…" not in details


def test_gloo_connection_errors_from_different_ports_group():
    messages = {rank: f"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                      f"[127.0.0.1]:{port}" for rank, port in {1: 45123, 2: 38817, 3: 51002}.items()}
    reports = {rank: _raised("RuntimeError", message, _traceback("RuntimeError", message, line=7))
               for rank, message in messages.items()}
    reports[0] = {"ok": True, "value": None}
    failure = RankFailure(reports)
    assert failure.summary() == f"ranks 1, 2, 3 raised RuntimeError: {messages[1]}"
    assert failure.details().count("Connection closed by peer") == 1
    assert "[127.0.0.1]:45123" in failure.details()


TIMED_GROUP = "<labkit.rank.instruments.timed_group.TimedGroup object at {address}>"


def test_tracebacks_whose_object_reprs_differ_group_but_different_lines_or_types_do_not():
    message = f"all_reduce on {TIMED_GROUP} timed out"
    reports = {
        0: _raised("RuntimeError", message.format(address=ADDRESSES[0]),
                   _traceback("RuntimeError", message.format(address=ADDRESSES[0]), line=4)),
        1: _raised("RuntimeError", message.format(address=ADDRESSES[1]),
                   _traceback("RuntimeError", message.format(address=ADDRESSES[1]), line=4)),
        # The same words, raised from another line of the cell: another place to look.
        2: _raised("RuntimeError", message.format(address=ADDRESSES[2]),
                   _traceback("RuntimeError", message.format(address=ADDRESSES[2]), line=9)),
        # The same words from another type of error.
        3: _raised("ValueError", message.format(address=ADDRESSES[3]),
                   _traceback("ValueError", message.format(address=ADDRESSES[3]), line=4)),
    }
    failure = RankFailure(reports)
    assert failure.summary().startswith(f"ranks 0, 1, 2 raised RuntimeError: all_reduce on <labkit.rank.instruments.timed_group"
                                        f".TimedGroup object at {ADDRESSES[0]}> timed out; rank 3 raised ValueError")
    headers = [line for line in failure.details().splitlines() if line.startswith("---")]
    assert headers == [
        "--- ranks 0, 1 (rank 0's shown; the others differ only in addresses, ports, ids and such) ---",
        "--- rank 2 ---",
        "--- rank 3 ---",
    ]


def _ddp_unused(rank, indices):
    return ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. You can enable unused "
            "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs "
            "participate in calculating loss. \nIf you already have done the above, then the distributed data "
            "parallel module wasn't able to locate the output tensors in the return value of your module's "
            "`forward` function. Please include the loss function and the structure of the return value of "
            "`forward` of your module when reporting this issue (e.g. list, dict, iterable).\n"
            f"Parameter indices which did not receive grad for rank {rank}: {indices}\n In addition, you can set the "
            "environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to print out information about "
            "which particular parameters did not receive gradient on this rank as part of this error")


def test_ddp_reducer_errors_group_across_their_own_rank_number_but_not_across_different_parameters():
    messages = {rank: _ddp_unused(rank, indices) for rank, indices in {0: "2 3", 1: "2 3", 2: "2 3", 3: "3"}.items()}
    reports = {rank: _raised("RuntimeError", message, _traceback("RuntimeError", message))
               for rank, message in messages.items()}
    failure = RankFailure(reports)
    details = failure.details()
    assert details.count("Expected to have finished reduction") == 2
    assert "--- ranks 0, 1, 2 (rank 0's shown" in details and "--- rank 3 ---" in details
    assert "did not receive grad for rank 0: 2 3" in details and "did not receive grad for rank 3: 3" in details
    assert "for rank 1:" not in details
    # The first lines are the same on every rank: the summary names the error once.
    assert failure.summary().startswith("ranks 0, 1, 2, 3 raised RuntimeError: Expected to have finished reduction")


def test_key_errors_on_object_ids_group():
    ids = [140234567890123, 140234567893456, 140511223344556]
    reports = {rank: _raised("KeyError", str(key), f"Traceback (most recent call last):\n"
                                                  f'  File "<lab cell In[3]>", line 5, in <module>\n'
                                                  f"    state = states[id(tensor)]\nKeyError: {key}\n")
               for rank, key in enumerate(ids)}
    failure = RankFailure(reports)
    assert failure.summary() == f"ranks 0, 1, 2 raised KeyError: {ids[0]}"
    assert failure.details().count("KeyError") == 1


def test_mismatched_collectives_naming_different_ranks_stay_apart():
    def mismatch(me, other, op_me, op_other):
        return (f"Detected mismatch between collectives on ranks. Rank {me} is running collective: "
                f"CollectiveFingerPrint(SequenceNumber=3, OpType={op_me}, TensorShape=[4], TensorDtypes=Float, "
                f"TensorDeviceTypes=TensorOptions(dtype=float, device=cpu)), but Rank {other} is running collective: "
                f"CollectiveFingerPrint(SequenceNumber=3, OpType={op_other}, TensorShape=[4], TensorDtypes=Float).")
    messages = {0: mismatch(0, 1, "ALLREDUCE", "BROADCAST"), 1: mismatch(1, 0, "BROADCAST", "ALLREDUCE")}
    failure = RankFailure({rank: _raised("RuntimeError", message, _traceback("RuntimeError", message))
                           for rank, message in messages.items()})
    assert failure.details().count("Detected mismatch") == 2
    assert "rank 0 raised RuntimeError" in failure.summary() and "rank 1 raised RuntimeError" in failure.summary()


def test_user_messages_naming_their_rank_stay_apart():
    reports = {rank: _raised("ValueError", f"rank {rank} is out of data", f"ValueError: rank {rank} is out of data")
               for rank in range(2)}
    assert RankFailure(reports).summary() == ("rank 0 raised ValueError: rank 0 is out of data; "
                                              "rank 1 raised ValueError: rank 1 is out of data")


def test_torch_rank_prefixes_are_the_reporters_own_rank_only():
    watchdog = ("[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for {ran} milliseconds before timing out.")
    texts = {0: watchdog.format(rank=0, ran=60012), 1: watchdog.format(rank=1, ran=60340),
             2: watchdog.format(rank=2, ran=60007)}
    assert group_alike(texts) == [([0, 1, 2], texts[0], False)]
    # A rank telling about a peer is not that peer telling about itself.
    assert comparable("[Rank 1] timed out", rank=0) != comparable("[Rank 1] timed out", rank=1)
    assert comparable("[rank3]:[E ProcessGroupGloo.cpp:143] boom", rank=3) == comparable(
        "[rank2]:[E ProcessGroupGloo.cpp:143] boom", rank=2)
    assert comparable("[PG ID 0 PG GUID 0(default_pg) Rank 3] watchdog ended", rank=3) == comparable(
        "[PG ID 0 PG GUID 0(default_pg) Rank 1] watchdog ended", rank=1)


def test_what_is_normalised():
    alike = [
        # pids where the text says so, the DataLoader's list of them, CUDA's out-of-memory "Process N has".
        ("DataLoader worker (pid(s) 12345, 12350) exited unexpectedly",
         "DataLoader worker (pid(s) 2231) exited unexpectedly"),
        ("worker pid=4411 ended", "worker pid=4523 ended"),
        ("Process 81234 has 79.14 GiB memory in use.", "Process 81240 has 79.14 GiB memory in use."),
        # Ports after an address, in each of torch's spellings; the store's (host, port) too.
        ("connect to 127.0.0.1:45123 failed", "connect to 127.0.0.1:39001 failed"),
        ("Connection reset by peer [::1]:45123", "Connection reset by peer [::1]:51234"),
        ("trying to connect to (127.0.0.1, 45123)", "trying to connect to (127.0.0.1, 45999)"),
        # Ids and pointers, thread ids, tensor storage pointers.
        ("Thread 0x00007f3a2c1b5e30 (most recent call first):", "Thread 0x00007f9d04a8c700 (most recent call first):"),
        ("tensor storage data_ptr=94523423423 freed", "tensor storage data_ptr=94523423999 freed"),
        ("<Thread(worker, started daemon 140234567890123)>", "<Thread(worker, started daemon 140511223344556)>"),
        ("stale handle id=1402345", "stale handle id=1409999"),
        # Temporary names, the lab's cell counters, clock times in log prefixes.
        ("No such file or directory: '/tmp/tmpab12cd34/ckpt.pt'",
         "No such file or directory: '/tmp/tmpzz9_xk01/ckpt.pt'"),
        ("[Errno 28] No space left on device: '/dev/shm/pymp-k2j4h6g8'",
         "[Errno 28] No space left on device: '/dev/shm/pymp-q1w2e3r4'"),
        ('File "<lab.run_cell 3>", line 2', 'File "<lab.run_cell 1>", line 2'),
        ("[E501 12:34:56.123456] boom", "[E501 12:34:56.654321] boom"),
    ]
    for first, second in alike:
        assert comparable(first) == comparable(second), (first, second)


def test_what_is_kept():
    apart = [
        ('File "<lab cell In[3]>", line 2, in <module>', 'File "<lab cell In[3]>", line 3, in <module>'),
        ("[/gloo/transport/tcp/pair.cc:534] closed", "[/gloo/transport/tcp/pair.cc:598] closed"),
        ("Connection closed by peer [10.0.0.1]:45123", "Connection closed by peer [10.0.0.2]:45123"),
        ("checksum 0x1a2b3c4d", "checksum 0x5e6f7a8b"),  # 32 bits: a code or a CRC, not an address
        ("could not allocate 1073741824 bytes", "could not allocate 2147483648 bytes"),  # sizes: 10 digits
        ("expected tensor(0.1234) got tensor(0.1235)", "expected tensor(0.1234) got tensor(0.1236)"),
        ("/tmp/data_rank1.pt", "/tmp/data_rank2.pt"),
        ("rank 1 is running collective X", "rank 2 is running collective X"),
    ]
    for first, second in apart:
        assert comparable(first, rank=1) != comparable(second, rank=2), (first, second)


def test_ranks_that_died_alike_are_explained_once():
    texts = {rank: {"ok": False, "error": {"kind": "died", "type": "ProcessDied", "traceback": "",
                                           "message": f"the rank's process exited (exit code 3; pid {pid})"}}
             for rank, pid in {1: 4411, 2: 4420}.items()}
    details = RankFailure(texts).details()
    assert details == "--- ranks 1, 2 (died) ---\nthe rank's process exited (exit code 3; pid 4411)"


def test_identical_texts_are_told_without_a_note():
    message = NOT_IN_MAP.format(address=ADDRESSES[0])
    reports = {rank: _raised("ValueError", message, _traceback("ValueError", message)) for rank in range(2)}
    failure = RankFailure(reports)
    assert failure.details().startswith("--- ranks 0, 1 ---\n")


def test_ranks_that_died_alike_are_told_once_though_each_keeps_its_own_log():
    # each dead rank's log is kept under its own name (rankN.died-K.log): that alone must not split the group
    died = "the rank's process exited (SIGKILL (exit code -9))\nits log: /tmp/labkit-ab12cd34/log/rank{}.died-{}.log"
    groups = group_alike({1: died.format(1, 1), 2: died.format(2, 3), 3: "the rank's process exited (SIGABRT)"})
    assert [ranks for ranks, _, _ in groups] == [[1, 2], [3]]
    # a rank naming another rank's log is not alike
    assert len(group_alike({1: died.format(1, 1), 2: died.format(1, 1)})) == 2
