"""The parameter server's pure parts: shard boundaries, the staleness gate and its bound, the catalog entry
(settings, defaults, refusals, options). No processes."""

import random

import pytest

from labkit.magics.train_args import train_parser
from labkit.spec.train_config import resolve
from labkit.strategies.catalog import compositions, role_of
from labkit.strategies.ps_gate import StalenessGate, shard_bounds, staleness_bound


def test_shards_are_contiguous_cover_everything_and_differ_by_at_most_one():
    for total, servers in [(10, 1), (10, 3), (7, 7), (1_000_003, 4)]:
        bounds = shard_bounds(total, servers)
        assert len(bounds) == servers and bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
        sizes = [end - start for start, end in bounds]
        assert max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="each needs at least one"):
        shard_bounds(3, 4)


def test_a_gate_of_zero_is_lockstep():
    gate = StalenessGate(3, 0)
    assert gate.pushed(0) == [] and gate.pushed(2) == []
    assert gate.pushed(1) == [0, 2, 1]  # the last of the round lets everyone go on, oldest first
    assert gate.pushed(0) == []
    with pytest.raises(ValueError, match="before it was answered"):
        gate.pushed(0)


def test_a_worker_more_than_k_ahead_waits_for_the_slowest():
    gate = StalenessGate(2, 1)
    assert gate.pushed(1) == [1]  # one ahead: within the bound
    assert gate.pushed(1) == []  # two ahead: held
    assert gate.lead(1) == 2
    assert gate.pushed(0) == [1, 0]  # the slowest caught up by one: both go on, oldest first


def _simulate(workers, bound, pick):
    """The server's protocol with arrivals chosen by ``pick``: (staleness of each applied push, leads answered)."""
    gate, version = StalenessGate(workers, bound), 0
    answered, computing = [0] * workers, set(range(workers))
    stale, leads = [], []
    for _ in range(400):
        worker = pick(sorted(computing))
        computing.discard(worker)
        stale.append(version - answered[worker])
        version += 1
        for ready in gate.pushed(worker):
            answered[ready] = version
            leads.append(gate.lead(ready))
            computing.add(ready)
    return stale, leads


@pytest.mark.parametrize("workers, bound", [(2, 1), (3, 1), (3, 2), (5, 3), (4, 0)])
def test_staleness_never_exceeds_the_derived_bound_in_any_arrival_order(workers, bound):
    rng = random.Random(workers * 10 + bound)
    worst = 0
    for trial in range(50):
        # Some workers much slower than others: the orders that make gradients stale.
        weights = [rng.choice((1, 1, 10, 30)) for _ in range(workers)]
        stale, leads = _simulate(workers, bound, lambda ready: rng.choices(ready, [weights[w] for w in ready])[0])
        assert max(leads) <= bound
        worst = max(worst, max(stale))
    assert worst <= staleness_bound(workers, bound)


def test_the_bound_is_reached():
    # Worker 0 pushes once, then worker 1 runs on until the gate holds it: its answer left worker 0
    # at version 1 and three updates landed before worker 0's next push: (W - 1)(2k + 1) = 3.
    order = iter([0, 1, 1, 1, 0])
    stale, _ = _simulate(2, 1, lambda ready: next(order, ready[0]))
    assert stale[:5] == [0, 1, 0, 0, 3] and stale[4] == staleness_bound(2, 1)


def test_the_catalog_entry_resolves_with_defaults_that_run():
    config = resolve(4, strategy="ps", model="mlp")
    assert config.options == {"servers": 1, "staleness": 0}
    assert config.data_parts == 3 and config.global_batch == 30  # 32 does not split over 3 workers
    assert [role_of(config.parts, config, rank) for rank in range(4)] == ["server", "worker", "worker", "worker"]
    two = resolve(4, strategy="ps", servers=2, staleness=1)
    assert two.data_parts == 2 and two.global_batch == 32
    assert resolve(4, strategy="ps", global_batch=12).global_batch == 12  # a batch given is kept
    assert "ps" in compositions(4) and not any("ps+" in name or "+ps" in name for name in compositions(4))


@pytest.mark.parametrize("settings, message", [
    (dict(servers=4), "leaves no worker"),
    (dict(servers=7), "leaves no worker"),
    (dict(staleness=1, verify=True), "nothing deterministic to compare with"),
    (dict(global_batch=32), "split evenly into 3 data-parallel replicas"),
    (dict(staleness=-1), r"staleness \(ps\) is an integer of at least 0"),
    (dict(strategy="ps+tp"), "ps runs alone"),
    (dict(checkpoint_every=2, checkpoint_dir="/tmp/nowhere"), "ps keeps no checkpoints yet"),
    (dict(strategy="ddp", servers=2), "servers is a setting of ps"),
])
def test_bad_settings_are_refused_before_any_rank_works(settings, message):
    with pytest.raises(ValueError, match=message):
        resolve(4, **{"strategy": "ps", **settings})


def test_the_magics_offer_the_settings():
    given = vars(train_parser().parse_args(["--strategy", "ps", "--servers", "2", "--staleness", "1"]))
    assert given == {"strategy": "ps", "servers": 2, "staleness": 1}


def test_servers_and_workers_are_compared_for_stragglers_only_among_themselves():
    from labkit.runs.training_run import TrainingRun
    from labkit.views.metrics import straggler_scores

    session = type("FourRanks", (), {"world_size": 4})()
    peers = TrainingRun(session, resolve(4, strategy="ps"), timeout=30, dashboard=False, background=False).table.peers_of
    assert peers[0] != peers[1] == peers[2] == peers[3]
    # A server busy 3x as long as the workers (W optimizer steps an iteration) is doing other work, not straggling.
    busy = {0: [0.03] * 5, 1: [0.01] * 5, 2: [0.01] * 5, 3: [0.011] * 5}
    assert not any(flagged for _, flagged in straggler_scores(busy, peers).values())
    busy[3] = [0.03] * 5  # a slow worker still is
    assert straggler_scores(busy, peers)[3][1]
