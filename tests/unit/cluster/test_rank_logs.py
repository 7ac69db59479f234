"""An ended rank's log moved aside before its replacement writes to the same name (no processes)."""

from labkit.cluster.rank_logs import keep_dead_log


def test_each_dead_ranks_log_is_kept_under_a_number_and_only_the_newest_stay(tmp_path):
    log = tmp_path / "rank1.log"
    kept = []
    for death in range(1, 6):
        log.write_text(f"why death {death}\n")
        kept.append(keep_dead_log(str(log), kept_per_rank=3))
        assert not log.exists()  # the replacement starts a log of its own
    assert kept == [str(tmp_path / f"rank1.died-{death}.log") for death in range(1, 6)]
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"rank1.died-{death}.log" for death in (3, 4, 5)]
    assert (tmp_path / "rank1.died-5.log").read_text() == "why death 5\n"


def test_nothing_to_keep_is_said_so(tmp_path):
    assert keep_dead_log(str(tmp_path / "rank2.log")) is None  # moved aside already, or written elsewhere
    (tmp_path / "rank2.log").write_text("")
    assert keep_dead_log(str(tmp_path / "rank2.log")) is None
    assert (tmp_path / "rank2.log").exists()
