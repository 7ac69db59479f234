"""The nccl path on a GPU, and the GPU check's own logic on CPU.

The ``gpu`` tests need a CUDA GPU and skip without one; ``bench/gpu.py`` runs the
same checks, and measures, on a machine lent with GPUs. The dry-run test runs that
script on gloo/CPU with tiny sizes, so its logic is tested everywhere.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import Lab

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = "no CUDA GPU visible: the nccl path is checked by bench/gpu.py on a GPU machine"
GPT = dict(vocab=64, dim=64, heads=4, layers=2, seq=32)


def on_gpu(test):
    """Marks a test gpu (and lab: it starts ranks) and skips it, saying why, without a CUDA GPU."""
    for mark in (pytest.mark.gpu, pytest.mark.lab, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def gpu_lab():
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    with Lab(ranks=1, backend="nccl", timeout=300, start_timeout=180) as running:
        yield running


def assert_rows_add_up(report):
    for result in report.results:
        assert result["rows"], f"rank {result['rank']} made no rows"
        for row in result["rows"]:
            assert row["seconds"] > 0 and row["compute"] > 0 and row["exposed_comm"] >= 0, row
            assert abs(row["compute"] + row["exposed_comm"] - row["seconds"]) <= 0.01 * row["seconds"] + 1e-7, row


@on_gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_rank_trains_equivalently_with_rows_that_add_up(gpu_lab, strategy):
    report = gpu_lab.train(strategy, "gpt", steps=6, global_batch=16, model_settings=GPT, verify=True,
                           instruments=True, log_every=100)
    assert report.equivalent is True, report.max_relative_difference
    assert_rows_add_up(report)
    assert report.device_name == torch.cuda.get_device_name(0)


@on_gpu
def test_bf16_reports_tokens_per_second_and_mfu(gpu_lab):
    report = gpu_lab.train("ddp", "gpt", steps=6, global_batch=16, model_settings=GPT, precision="bf16",
                           log_every=100)
    assert report.tokens_per_second > 0
    assert report.model_flops_per_step > 0 and report.achieved_tflops > 0
    if report.peak_tflops is None:  # a GPU whose peak labkit does not know: no MFU, and it says so
        assert report.mfu is None
    else:
        assert 0 < report.mfu <= 1


@on_gpu
def test_allreduce_bench_runs_on_the_device(gpu_lab):
    bench = gpu_lab.bench_collective("all_reduce", sizes=[2**12, 2**20, 2**24], iterations=10)
    assert bench.sizes == [2**12, 2**20, 2**24]
    assert all(seconds > 0 for seconds in bench.seconds)
    # The ceiling is a device-to-device copy: far above what one CPU thread copies (~10-30 GB/s).
    assert bench.memcpy > 50e9, f"copy bandwidth {bench.memcpy / 1e9:.1f} GB/s looks like a CPU copy"


@pytest.mark.lab
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, IPP_NONINTERACTIVE="1")
    finished = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--cpu-dry-run", "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = (finished.stdout + finished.stderr)[-6000:]
    assert finished.returncode == 0, output
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["passed"] is True
    assert record["errors"] == {}, record["errors"]
    for part in ("performance", "correctness", "mixed_precision", "collective", "instrument_accuracy"):
        assert record[part], f"{part} is missing from the results\n{output}"
    assert {run["strategy"] for run in record["correctness"]["runs"]} == {"ddp", "fsdp", "tp", "pp", "ps", "diloco"}
    assert all(run["equivalent"] for run in record["correctness"]["runs"])
    assert not [check for check in record["checks"] if check["kind"] == "correctness" and check["verdict"] == "FAIL"]
