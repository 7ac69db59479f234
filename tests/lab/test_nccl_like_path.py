"""The GPU path's group handling, on CPU: two real gloo processes whose groups answer as nccl does.

``tests/nccl_like_group.NcclLikeGroup`` wraps a gloo group so that a synchronous
collective answers no work (nccl since torch 2.8) and sends and receives can be
coalesced. Through the lab's ``TimedGroup`` on top of it:

- a synchronous all-reduce returns None to torch, is counted and recorded, leaves
  nothing in flight, and a slow link still slows it;
- a pipeline's batch of a send and a receive is posted as one coalesced group
  inside ``p2p_batched`` (alone outside it: what would block on nccl);
- destroying the world shuts the real group down once, not twice;
- the nccl backend gets a looser time limit than gloo's.
"""

from __future__ import annotations

import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.rank.environment import nccl_seconds
from labkit.rank.instruments.recorder import StepRecorder
from labkit.rank.instruments.slow_link import LinkState
from labkit.rank.instruments.timed_group import wrap_group
from labkit.spec.link import LinkSpec
from labkit.torch_support import torch_internals
from tests.nccl_like_group import NcclLikeGroup


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _exchange(timed, rank: int, batched: bool) -> torch.Tensor:
    peer = 1 - rank
    sent, received = torch.full((1024,), float(rank + 1)), torch.zeros(1024)
    ops = [dist.P2POp(dist.isend, sent, peer, group=timed), dist.P2POp(dist.irecv, received, peer, group=timed)]
    if batched:
        with timed.p2p_batched(torch.device("cpu")):
            works = dist.batch_isend_irecv(ops)
    else:
        works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return received


def _checks(rank: int, port: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=10))
    world = dist.group.WORLD
    fake = NcclLikeGroup(world)
    torch_internals.take_place_of(world, fake)  # registered, as a real group is
    recorder = StepRecorder(rank)
    timed = wrap_group(fake, recorder)
    out = {}

    recorder.begin_step(0)
    tensor = torch.full((4,), float(rank + 1))
    out["answer"] = dist.all_reduce(tensor, group=timed)
    row = recorder.end_step(samples=1, tokens=None, loss=None)
    out["sum"] = tensor.tolist()
    out["none_answers"] = fake.answered_none
    out["issued"], out["collectives"], out["in_flight"] = timed.issued, timed.collectives, timed.pending()
    out["row_bytes"] = dict(row["bytes"])

    timed.link = LinkState()
    timed.link.spec = LinkSpec(None, 0.2)  # 200 ms of latency per message
    began = time.perf_counter()
    dist.all_reduce(tensor, group=timed)
    out["slowed_seconds"] = time.perf_counter() - began
    timed.link = None

    out["alone_received"] = _exchange(timed, rank, batched=False)[0].item()
    out["alone"] = fake.p2p_alone
    out["batched_received"] = _exchange(timed, rank, batched=True)[0].item()
    out["alone_after_batch"], out["grouped"] = fake.p2p_alone, fake.p2p_grouped

    torch_internals.set_group_timeout(fake, timedelta(seconds=7), timedelta(seconds=nccl_seconds(7)))
    out["gloo_limit"] = torch_internals.backend_timeout(fake, torch.device("cpu")).total_seconds()

    dist.destroy_process_group()
    out["shutdowns"] = fake.shutdowns
    return out


def _worker(rank: int, port: int, results) -> None:
    try:
        results[rank] = _checks(rank, port)
    except BaseException:  # noqa: BLE001 - the test shows the rank's traceback
        results[rank] = {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def outcomes():
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        processes = [context.Process(target=_worker, args=(rank, port, results)) for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
            if process.is_alive():
                process.kill()
                pytest.fail("a rank did not finish in 120 s")
        found = {rank: dict(results[rank]) for rank in range(2)}
    for rank, result in found.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return found


def test_a_synchronous_collective_that_answers_no_work_is_timed_and_returns_none(outcomes):
    for rank, result in outcomes.items():
        assert result["answer"] is None and result["sum"] == [3.0] * 4
        assert result["none_answers"] >= 1
        assert (result["issued"], result["collectives"], result["in_flight"]) == (1, 1, [])
        assert result["row_bytes"] == {"all_reduce": 16}


def test_a_slow_link_slows_a_collective_that_answers_no_work(outcomes):
    assert all(result["slowed_seconds"] >= 0.2 for result in outcomes.values())


def test_a_pipeline_batch_is_posted_as_one_group_through_the_timed_group(outcomes):
    for rank, result in outcomes.items():
        assert result["alone_received"] == result["batched_received"] == float(2 - rank)
        assert result["alone"] == 2  # torch posts a Python group's batch one by one
        assert result["alone_after_batch"] == 2 and result["grouped"] == 2


def test_destroying_the_world_shuts_the_real_group_down_once(outcomes):
    assert [result["shutdowns"] for result in outcomes.values()] == [1, 1]


def test_gloo_keeps_the_cell_limit_and_nccl_gets_a_looser_one(outcomes):
    assert all(result["gloo_limit"] == 7.0 for result in outcomes.values())
    assert nccl_seconds(7) > 7 + 3 + 10  # past the limit, the settle time and an interrupt's grace


def test_only_a_group_that_coalesces_batches_its_sends_and_receives():
    class Plain:
        pass

    class Coalescing:
        supports_coalescing = True

    assert not torch_internals.coalesces_p2p(Plain(), torch.device("cpu"))
    assert torch_internals.coalesces_p2p(Coalescing(), torch.device("cpu"))


def test_a_step_that_fails_inside_a_batch_posts_nothing_more_and_the_error_shows():
    class Coalescing:
        supports_coalescing = True

    from labkit.rank.instruments.timed_group import TimedGroup

    group = TimedGroup.__new__(TimedGroup)  # only the batching state is used here: no real group needed
    group.inner, group._p2p_batch = Coalescing(), None
    with pytest.raises(ValueError, match="the user's loss"):
        with TimedGroup.p2p_batched(group, torch.device("cpu")):
            group._p2p_batch.keep("send", 4, "send", [torch.zeros(1)], (1, 0), {})
            raise ValueError("the user's loss")
    assert group._p2p_batch is None  # and nothing was posted: posting would have needed a real group
