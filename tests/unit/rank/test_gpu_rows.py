"""GPU step rows from event times, model FLOPs and MFU: pure logic, no processes, no GPU.

``gpu_instruments.assemble_row`` turns the times of a step's CUDA events into
the same row a CPU rank makes; these tests feed it times by hand.
"""

import pytest

from labkit.spec.device_peaks import peak_tflops
from labkit.rank.instruments.gpu_recorder import assemble_row, exposed_regions, union_length
from labkit.zoo.configs import GPTConfig, MLPConfig
from labkit.zoo.models import MLP, TinyGPT
from labkit.spec.train_config import resolve
from labkit.views.train_report import TrainReport

STEP = {"step": 7, "rank": 1, "samples": 8, "tokens": 256, "loss": 2.5, "delay": 0.0}


def test_union_of_wait_intervals_inside_the_step():
    assert union_length([], 0.0, 1.0) == 0.0
    assert union_length([(0.1, 0.3), (0.2, 0.4)], 0.0, 1.0) == pytest.approx(0.3)  # overlapping
    assert union_length([(0.1, 0.2), (0.15, 0.18), (0.5, 0.6)], 0.0, 1.0) == pytest.approx(0.2)  # nested
    assert union_length([(-0.5, 0.1), (0.9, 1.5)], 0.0, 1.0) == pytest.approx(0.2)  # clipped to the step


def test_compute_and_exposed_communication_add_up_to_the_step():
    times = {
        "start": 10.0, "end": 10.050, "origin_wall": 1000.0,
        # the compute stream waited 4 ms inside a TP all-reduce and 6 ms at the end of backward
        "regions": [(10.010, 10.014), (10.040, 10.046)],
        "collectives": [("all_reduce", 4096, 10.009, 10.014), ("all_reduce", 8192, 10.030, 10.046),
                        ("all_gather", 1024, 10.001, 10.002)],
    }
    row, entry = assemble_row(STEP, times)
    assert row["seconds"] == pytest.approx(0.050)
    assert row["exposed_comm"] == pytest.approx(0.010)
    assert row["compute"] + row["exposed_comm"] == pytest.approx(row["seconds"])
    assert row["comm"] == {"all_reduce": pytest.approx(0.021), "all_gather": pytest.approx(0.001)}
    assert row["bytes"] == {"all_reduce": 12288, "all_gather": 1024}
    assert row["start"] == pytest.approx(1010.0) and row["loss"] == 2.5
    # The timeline: busy spans cover the step exactly, idle where the stream waited.
    spans = entry["busy"]
    assert spans[0][0] == pytest.approx(1010.0) and spans[-1][1] == pytest.approx(1010.050)
    assert sum(b - a for a, b, busy in spans if busy == 0.0) == pytest.approx(0.010)
    assert all(later[0] == pytest.approx(earlier[1]) for earlier, later in zip(spans, spans[1:]))
    assert entry["collectives"][0] == ("all_reduce", 4096, pytest.approx(1010.009), pytest.approx(1010.014))


def test_a_step_that_only_waits_is_all_exposed():
    times = {"start": 0.0, "end": 0.02, "origin_wall": 0.0, "regions": [(-1.0, 1.0)],
             "collectives": [("all_reduce", 64, -1.0, 1.0)]}
    row, _ = assemble_row(STEP, times)
    assert row["exposed_comm"] == pytest.approx(0.02) and row["compute"] == pytest.approx(0.0)


def test_a_wait_bracket_counts_only_until_what_it_waited_for_completed():
    # FSDP's pre-forward bracket: 1 ms waiting for the all-gather, then 3 ms copying the gathered
    # parameters out on the same stream (compute). DDP's end of backward: 2 ms for the last bucket,
    # then 5 ms copying buckets into the gradients.
    times = {
        "start": 0.0, "end": 0.050, "origin_wall": 0.0,
        "regions": [(0.010, 0.014), (0.040, 0.047)],
        "collectives": [("all_gather", 1024, 0.009, 0.011), ("all_reduce", 4096, 0.030, 0.042)],
    }
    row, entry = assemble_row(STEP, times)
    assert row["exposed_comm"] == pytest.approx(0.003)
    assert sum(b - a for a, b, busy in entry["busy"] if busy == 0.0) == pytest.approx(0.003)
    assert exposed_regions(times["regions"], times["collectives"]) == [(0.010, pytest.approx(0.011)),
                                                                      (0.040, pytest.approx(0.042))]


def test_a_wait_for_work_already_done_exposes_nothing():
    # One GPU: FSDP's all-gather of one rank ends before the layer asks for it; only the copy-out is left.
    times = {"start": 0.0, "end": 0.020, "origin_wall": 0.0, "regions": [(0.010, 0.013)],
             "collectives": [("all_gather", 1024, 0.002, 0.004)]}
    row, _ = assemble_row(STEP, times)
    assert row["exposed_comm"] == 0.0 and row["compute"] == pytest.approx(0.020)


def test_parameter_counts_and_flops_follow_the_models():
    for config in (GPTConfig(), GPTConfig(vocab=256, dim=512, heads=8, layers=8, seq=256)):
        assert config.parameters == sum(p.numel() for p in TinyGPT(config).parameters())
    assert MLPConfig().parameters == sum(p.numel() for p in MLP(MLPConfig()).parameters())
    big = GPTConfig(vocab=256, dim=512, heads=8, layers=8, seq=256)
    # 6 per weight and token (position table excluded) + attention 12 x layers x dim x seq, per token
    per_token = 6 * (big.parameters - 256 * 512) + 12 * 8 * 512 * 256
    assert big.training_flops_per_sample() == per_token * 256
    assert MLPConfig().training_flops_per_sample() == 6 * MLPConfig().parameters


def test_peaks_and_model_flops_utilisation():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H200 NVL", "bf16") == 835.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("cpu") is None and peak_tflops("Some Future GPU", "bf16") is None
    config = resolve(1, strategy="ddp", model="gpt", precision="bf16", global_batch=32,
                     model_settings=dict(vocab=256, dim=512, heads=8, layers=8, seq=256))
    result = {"rank": 0, "coordinate": {"dp": 0}, "owns_loss": True, "losses": [3.0, 2.0],
              "step_seconds": [0.05, 0.01], "steps_done": 2, "rows": [], "timeline": [],
              "memory": {"params": 1, "grads": 1, "optimizer": 2}, "device_name": "NVIDIA H200"}
    report = TrainReport(config, [result])
    assert report.model_flops_per_step == config.model_config.training_flops_per_sample() * 32
    assert report.achieved_tflops == pytest.approx(report.model_flops_per_step / 0.01 / 1e12)
    assert report.mfu == pytest.approx(report.achieved_tflops / 989.0)
    assert "MFU" in str(report) and "bf16 peak (989 TFLOP/s each)" in str(report)
    unknown = TrainReport(config, [dict(result, device_name="Some Future GPU")])
    assert unknown.mfu is None and "give peak_tflops" in str(unknown)
    given = TrainReport(resolve(1, strategy="ddp", model="gpt", peak_tflops=100.0), [dict(result, device_name="cpu")])
    assert given.peak_tflops == 100.0 and given.mfu is not None
    cpu = TrainReport(resolve(1, strategy="ddp", model="gpt"), [dict(result, device_name="cpu")])
    assert cpu.mfu is None and "MFU" not in str(cpu)
