"""Timelines and Chrome traces from per-step entries (no processes)."""

import json

from labkit.runs.bench import CollectiveBench
from labkit.views.timeline import Timeline


def entries(rank, steps=3):
    result = []
    for step in range(steps):
        start = 10.0 + step
        result.append({
            "step": step, "rank": rank, "start": start, "end": start + 0.9,
            "busy": [(start, start + 0.3, 1.0), (start + 0.3, start + 0.9, 0.1)],
            "collectives": [("all_reduce", 4096, start + 0.2, start + 0.8), ("send", 128, start + 0.25, start + 0.26)],
        })
    return result


def test_waiting_fraction_and_last_steps():
    timeline = Timeline({0: entries(0), 1: entries(1)}, steps=2)
    assert [e["step"] for e in timeline.entries[0]] == [1, 2]
    assert round(timeline.waiting_fraction(0), 3) == round((0.6 * 0.9) / 0.9, 3)
    assert "2 step(s) on 2 ranks" in repr(timeline)


def test_chrome_trace_has_a_process_per_rank_and_paired_collectives(tmp_path):
    trace = json.loads(open(Timeline({0: entries(0), 1: entries(1)}).export_trace(str(tmp_path / "t.json"))).read())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} == {"compute", "waiting", "step 0", "step 1", "step 2"}
    assert all(e["dur"] >= 0 for e in complete)
    begins = {e["id"] for e in events if e["ph"] == "b"}
    ends = {e["id"] for e in events if e["ph"] == "e"}
    assert begins == ends and len(begins) == 2 * 2 * 3
    assert next(e for e in events if e["ph"] == "b")["args"]["bytes"] == 4096


def test_pictures_render_as_png():
    assert Timeline({0: entries(0)})._repr_png_().startswith(b"\x89PNG")
    bench = CollectiveBench("all_reduce", 4, [1024, 4096], [[0.001, 0.002]] * 4, memcpy=5e9)
    assert bench._repr_png_().startswith(b"\x89PNG")


def test_bus_bandwidth_follows_nccl_tests():
    per_rank = [[0.001, 0.002], [0.0015, 0.001], [0.001, 0.001], [0.001, 0.001]]
    bench = CollectiveBench("all_reduce", 4, [1024, 4096], per_rank, memcpy=5e9)
    assert bench.seconds == [0.0015, 0.002]  # the slowest rank per size
    assert bench.algbw == [1024 / 0.0015, 4096 / 0.002]
    assert [round(b / a, 6) for a, b in zip(bench.algbw, bench.busbw)] == [1.5, 1.5]  # 2(n-1)/n
    gather = CollectiveBench("all_gather", 4, [1024], [[0.001]] * 4, memcpy=5e9)
    assert round(gather.busbw[0] / gather.algbw[0], 6) == 0.75
    assert "memory copy on this machine: 5.0 GB/s" in str(bench)


def test_a_timeline_counts_the_steps_it_shows():
    assert Timeline({0: entries(0)}, steps=1).figure().axes[0].get_title().startswith("last step per rank")
    assert Timeline({0: entries(0)}, steps=2).figure().axes[0].get_title().startswith("last 2 steps per rank")


def test_pipeline_timelines_name_their_schedule():
    from labkit.spec.train_config import resolve
    from labkit.views.train_report import timeline_title

    shown = {0: entries(0), 1: entries(1)}
    gpipe = resolve(2, strategy="pp", model="gpt", micro_batches=8, schedule="gpipe")
    one_f_one_b = resolve(2, strategy="pp", model="gpt", micro_batches=8, schedule="1f1b")
    assert timeline_title(gpipe, shown, 1).endswith("GPipe schedule, 8 microbatches: last step")
    assert timeline_title(one_f_one_b, shown, 1).endswith("1F1B schedule, 8 microbatches: last step")
    assert timeline_title(one_f_one_b, shown, None).endswith(": last 3 steps")
    assert "schedule" not in timeline_title(resolve(2, strategy="ddp"), shown, 2)
