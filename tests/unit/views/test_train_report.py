"""``TrainReport`` from hand-made rank results: every derived number checked against hand arithmetic.

A result dict has the keys ``labkit.rank.loop._train`` returns (rank, coordinate,
owns_loss, losses, step_seconds, steps_done, memory, rows, timeline,
device_name, optionally verify); a row has the keys ``StepRecorder.end_step``
writes. Pure: no ranks, no torch.
"""

import statistics

import pytest

from labkit.spec.train_config import resolve
from labkit.views.train_report import TrainReport

MLP_PARAMETERS = 128 * 512 + 512 + 512 * 512 + 512 + 512 * 512 + 512 + 512 * 128 + 128  # the default mlp
assert MLP_PARAMETERS == 657_024

# Six steps on four ranks. The slowest rank of each step is a different one
# (0, 1, 2, 3, 0, 1); step 0 is the warm-up. Per step, the slowest is
# [0.5, 0.02, 0.04, 0.03, 0.01, 0.09]: the median of steps 1-5 is 0.03 s (their
# mean is 0.038 s, and the median with step 0 would be 0.035 s).
STEP_SECONDS = [
    [0.50, 0.015, 0.020, 0.020, 0.010, 0.060],
    [0.30, 0.020, 0.030, 0.010, 0.005, 0.090],
    [0.20, 0.010, 0.040, 0.025, 0.008, 0.050],
    [0.10, 0.018, 0.035, 0.030, 0.009, 0.070],
]
SLOWEST = [0.5, 0.02, 0.04, 0.03, 0.01, 0.09]
MEDIAN = 0.03

# Rank 2 holds the most in total (1.3 MB); rank 0 has the largest parameters.
MEMORY = [
    {"params": 500_000, "grads": 500_000, "optimizer": 0},
    {"params": 100_000, "grads": 100_000, "optimizer": 200_000},
    {"params": 300_000, "grads": 300_000, "optimizer": 700_000},
    {"params": 200_000, "grads": 200_000, "optimizer": 400_000},
]


def row(rank, step, seconds, compute, sent, samples=8, tokens=None, loss=1.0, delay=0.0):
    """One row as ``StepRecorder.end_step`` makes it."""
    return {
        "step": step,
        "rank": rank,
        "start": 1000.0 + step,
        "seconds": seconds,
        "compute": compute,
        "exposed_comm": seconds - compute,
        "comm": {kind: 0.001 for kind in sent},
        "bytes": dict(sent),
        "samples": samples,
        "tokens": tokens,
        "loss": loss,
        "delay": delay,
    }


def fsdp_rows(rank):
    """Step 0 also broadcasts 50 MB (a one-off that must not count); steady steps gather and
    reduce-scatter. all_gather varies by step (mean 3 MB), reduce_scatter by rank ((rank+1) MB)."""
    gathered = [None, 2_000_000, 4_000_000, 3_000_000, 3_500_000, 2_500_000]
    rows = [row(rank, 0, 0.5, 0.4, {"broadcast": 50_000_000, "all_gather": 9_000_000})]
    for step in range(1, 6):
        sent = {"all_gather": gathered[step], "reduce_scatter": (rank + 1) * 1_000_000}
        if rank == 0 and step == 3:
            sent["barrier"] = 40  # a kind far under 0.1% of the traffic
        rows.append(row(rank, step, STEP_SECONDS[rank][step], compute=0.001 * step * (rank + 1), sent=sent))
    return rows


def result(rank, coordinate, losses, owns_loss=True, steps=6, **extra):
    out = {
        "rank": rank,
        "coordinate": coordinate,
        "owns_loss": owns_loss,
        "losses": losses,
        "step_seconds": STEP_SECONDS[rank][:steps],
        "steps_done": steps,
        "memory": MEMORY[rank],
        "rows": fsdp_rows(rank)[:steps],
        "timeline": [{"step": s} for s in range(steps)],
        "device_name": "cpu",
    }
    out.update(extra)
    return out


# Replica r's loss at step s is 2 - 0.1 s + 0.01 r; the dp mean is 2 - 0.1 s + 0.015.
def replica_losses(rank):
    return [2.0 - 0.1 * step + 0.01 * rank for step in range(6)]


def fsdp_report(steps=6, ranks_steps=None, **settings):
    config = resolve(4, strategy="fsdp", model="mlp", steps=steps, global_batch=32, **settings)
    ranks_steps = ranks_steps or [6] * 4
    results = [result(r, {"dp": r}, replica_losses(r)[: ranks_steps[r]], steps=ranks_steps[r]) for r in range(4)]
    return TrainReport(config, results)


# -- steps and time ----------------------------------------------------------------


def test_each_step_takes_as_long_as_its_slowest_rank():
    assert fsdp_report().step_seconds == SLOWEST


def test_the_median_step_leaves_out_the_warm_up_step():
    assert fsdp_report().median_step_seconds == pytest.approx(MEDIAN)


def test_throughput_is_the_global_batch_over_the_median_step():
    report = fsdp_report()
    assert report.samples_per_second == pytest.approx(32 / MEDIAN)  # 1066.67
    assert report.tokens_per_second is None  # the mlp has no tokens


def test_a_single_step_run_uses_that_step():
    report = fsdp_report(steps=1, ranks_steps=[1, 1, 1, 1])
    assert report.median_step_seconds == pytest.approx(0.5)
    assert report.samples_per_second == pytest.approx(64.0)


def test_steps_done_is_what_every_rank_completed():
    # Rank 1 reports a sixth step the others never finished: it counts nowhere.
    report = fsdp_report(steps=20, ranks_steps=[5, 6, 5, 5])
    assert report.steps_done == 5
    assert report.step_seconds == SLOWEST[:5]
    assert len(report.losses) == 5
    assert report.median_step_seconds == pytest.approx(statistics.median([0.02, 0.04, 0.03, 0.01]))


def test_stopped_early_only_when_fewer_steps_than_asked():
    assert fsdp_report(steps=20, ranks_steps=[6, 6, 6, 6]).stopped_early
    assert "20 steps (stopped after 6), global batch 32" in str(fsdp_report(steps=20))
    finished = fsdp_report(steps=6)
    assert not finished.stopped_early
    assert "stopped" not in str(finished)
    assert "6 steps, global batch 32" in str(finished)


# -- loss -------------------------------------------------------------------------


def test_the_loss_is_the_mean_over_data_parallel_replicas():
    losses = fsdp_report().losses
    assert losses == pytest.approx([2.015 - 0.1 * step for step in range(6)])


def test_under_pp_the_loss_comes_from_the_stage_that_owns_it():
    config = resolve(4, strategy="pp", model="mlp", steps=6, global_batch=32)
    last_stage = [3.0, 2.5, 2.25, 2.0, 1.75, 1.5]
    results = [
        result(r, {"pp": r}, last_stage if r == 3 else None, owns_loss=(r == 3))
        for r in range(4)
    ]
    report = TrainReport(config, results)
    assert report.losses == last_stage
    assert "loss 3.0000 -> 1.5000" in str(report)


def test_only_the_first_tensor_parallel_rank_of_a_replica_counts_its_loss():
    config = resolve(4, strategy="fsdp+tp", model="mlp", steps=6, global_batch=32, mesh={"dp": 2, "tp": 2})
    coordinates = [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    # tp=1 ranks report a loss far off: counting them (or counting replica 0 twice) changes the mean.
    losses = {0: [1.0] * 6, 1: [9.0] * 6, 2: [3.0] * 6, 3: [9.0] * 6}
    report = TrainReport(config, [result(r, coordinates[r], losses[r]) for r in range(4)])
    assert report.losses == [2.0] * 6


# -- communication ------------------------------------------------------------------


def test_communication_per_step_is_the_steady_mean_summed_over_ranks():
    # all_gather: mean of steps 1-5 is 3 MB on each of 4 ranks; reduce_scatter 1+2+3+4 MB;
    # barrier 40 bytes once in rank 0's 5 steady steps; step 0's broadcast left out.
    assert fsdp_report().comm_bytes_per_step == {
        "all_gather": 12_000_000,
        "barrier": 8,
        "reduce_scatter": 10_000_000,
    }


def test_communication_per_rank_and_step():
    assert fsdp_report().comm_bytes_per_rank == pytest.approx(22_000_008 / 4)


def test_a_rank_with_one_row_counts_that_row():
    report = fsdp_report(ranks_steps=[1, 1, 1, 1], steps=1)
    # Only the warm-up row exists: it is all there is to count.
    assert report.comm_bytes_per_step == {"all_gather": 36_000_000, "broadcast": 200_000_000}


def test_per_rank_means_of_a_row_field_leave_out_the_warm_up():
    report = fsdp_report()
    # compute of rank r at step s is 0.001 s (r + 1): steps 1-5 average 0.003 (r + 1).
    assert report.per_rank_means("compute") == pytest.approx([0.003, 0.006, 0.009, 0.012])
    assert report.per_rank_means("seconds") == pytest.approx(
        [statistics.fmean(STEP_SECONDS[r][1:]) for r in range(4)]
    )
    no_rows = TrainReport(report.config, [dict(r, rows=[]) for r in report.results])
    assert no_rows.per_rank_means("compute") == [0.0] * 4
    assert no_rows.comm_bytes_per_step == {}


def test_summary_reports_communication_per_rank_leaving_out_tiny_kinds():
    text = str(fsdp_report())
    line = next(line for line in text.splitlines() if line.startswith("communication per rank and step"))
    assert line == "communication per rank and step: 5.5 MB (all_gather 3.0 MB, reduce_scatter 2.5 MB)"


# -- memory -------------------------------------------------------------------------


def test_max_memory_is_the_largest_rank_total():
    report = fsdp_report()
    assert report.memory == MEMORY
    assert report.max_memory_bytes == 1_300_000


def test_memory_budget_verdict_within_and_over():
    within = str(fsdp_report(max_memory=1_300_000))
    assert "memory budget 1.3 MB per rank: largest rank uses 1.3 MB (within)" in within
    over = str(fsdp_report(max_memory=1_299_999))
    assert "largest rank uses 1.3 MB (OVER)" in over
    assert "memory budget" not in str(fsdp_report())  # no budget asked, none told


def test_the_memory_table_has_one_line_per_rank_in_rank_order():
    lines = str(fsdp_report()).splitlines()
    table = lines[lines.index("memory per rank:") + 1 :]
    assert table[0].split() == ["rank", "mesh", "params", "grads", "optimizer", "total"]
    assert [line.split() for line in table[1:]] == [
        ["0", "dp=0", "500.0", "kB", "500.0", "kB", "0", "B", "1.0", "MB"],
        ["1", "dp=1", "100.0", "kB", "100.0", "kB", "200.0", "kB", "400.0", "kB"],
        ["2", "dp=2", "300.0", "kB", "300.0", "kB", "700.0", "kB", "1.3", "MB"],
        ["3", "dp=3", "200.0", "kB", "200.0", "kB", "400.0", "kB", "800.0", "kB"],
    ]


# -- the summary ------------------------------------------------------------------------


def test_summary_lines_carry_the_derived_numbers():
    report = fsdp_report()
    lines = report.summary_lines()
    assert lines[0] == "mlp under fsdp on mesh dp=4: 6 steps, global batch 32"
    assert lines[1] == "loss 2.0150 -> 1.5150"
    assert lines[2] == "step time 30.0 ms (median, slowest rank), 1,067 samples/s"
    assert not any("FLOP" in line for line in lines)  # a CPU has no peak: no FLOPs line


def test_str_and_pretty_repr_show_the_same_report():
    report = fsdp_report()
    text = str(report)
    assert text.splitlines()[: len(report.summary_lines())] == report.summary_lines()

    class Printer:
        def __init__(self):
            self.out = ""

        def text(self, value):
            self.out += value

    printer = Printer()
    report._repr_pretty_(printer, cycle=False)
    assert printer.out == text
    page = report._repr_html_()
    assert "1,067 samples/s" in page and "<td style='padding:2px 8px'>1.3 MB</td>" in page


def test_gpt_throughput_in_tokens():
    config = resolve(4, strategy="fsdp", model="gpt", steps=6, global_batch=32)
    report = TrainReport(config, [result(r, {"dp": r}, replica_losses(r)) for r in range(4)])
    assert report.tokens_per_second == pytest.approx(32 / MEDIAN * 32)  # seq 32
    assert "1,067 samples/s (34,133 tokens/s)" in str(report)


# -- FLOPs and MFU --------------------------------------------------------------------


def test_model_flops_and_mfu_against_a_given_peak():
    report = fsdp_report(peak_tflops=0.001)
    per_step = 6 * MLP_PARAMETERS * 32
    assert report.model_flops_per_step == per_step == 126_148_608
    assert report.achieved_tflops == pytest.approx(per_step / MEDIAN / 1e12)
    # Four devices of 0.001 TFLOP/s each: 0.0042049536 / 0.004.
    assert report.mfu == pytest.approx(1.0512384)
    assert "model FLOPs 0.0 TFLOP/s on 4 x cpu, MFU 105.1% of the fp32 peak (0.001 TFLOP/s each)" in str(report)


def test_mfu_uses_the_data_sheet_peak_of_the_device_and_math():
    config = resolve(4, strategy="fsdp", model="mlp", steps=6, global_batch=32, precision="bf16")
    results = [result(r, {"dp": r}, replica_losses(r), device_name="NVIDIA H100 80GB HBM3") for r in range(4)]
    report = TrainReport(config, results)
    assert report.peak_tflops == 989.0
    assert report.mfu == pytest.approx(126_148_608 / MEDIAN / 1e12 / (989.0 * 4))
    assert "of the bf16 peak (989 TFLOP/s each)" in str(report)


def test_an_unknown_device_has_no_mfu_and_says_so():
    config = resolve(4, strategy="fsdp", model="mlp", steps=6, global_batch=32)
    results = [result(r, {"dp": r}, replica_losses(r), device_name="Tesla K80") for r in range(4)]
    report = TrainReport(config, results)
    assert report.peak_tflops is None and report.mfu is None
    assert "MFU unknown: no fp32 peak known for this device (give peak_tflops=...)" in str(report)
    assert report.device_name == "Tesla K80"


# -- equivalence ------------------------------------------------------------------------


def verified(difference, noise):
    report = fsdp_report()
    report.results[0]["verify"] = {
        "max_relative_difference": difference,
        "rounding_noise": noise,
        "model_moved": 0.25,
    }
    return report


def test_equivalence_within_the_rounding_noise_bound():
    assert verified(9e-6, 0.0).equivalent  # under the 1e-5 floor
    assert not verified(1e-5, 0.0).equivalent  # the bound itself is not under it
    assert verified(4e-5, 5e-6).equivalent  # 10 x noise = 5e-5
    assert not verified(6e-5, 5e-6).equivalent
    assert verified(9e-4, 1e-3).equivalence_bound == pytest.approx(1e-3)  # capped
    assert not verified(2e-3, 1e-2).equivalent  # noise this large never excuses 2e-3
    text = str(verified(4e-5, 5e-6))
    assert "largest relative difference of a parameter 4.0e-05 (equal within max(1e-05, 10 x" in text
    assert "training moved the model 25.0% from its start" in text
    assert "NOT equal" in str(verified(6e-5, 5e-6))


def test_without_verify_there_is_no_verdict():
    report = fsdp_report()
    assert report.verify is None and report.equivalent is None and report.equivalence_bound is None
    assert "single-process" not in str(report)


def test_a_run_without_instruments_has_no_timeline():
    report = fsdp_report()
    report.results[2]["timeline"] = []
    with pytest.raises(ValueError, match="instruments=False"):
        report.timeline()


@pytest.mark.parametrize("run, reference, said", [
    (12, 0, "12 of this run's parameters hold NaN or infinity; the single-process reference's are all finite"),
    (0, 3, "this run's parameters are all finite; 3 of the single-process reference's hold NaN or infinity"),
    (12, 12, "12 of this run's parameters hold NaN or infinity; 12 of the single-process reference's hold NaN"),
])
def test_a_side_that_is_not_finite_is_never_called_equal_and_is_named(run, reference, said):
    report = verified(0.0, float("nan"))  # what NaN parameters gave before: no difference found, "equal"
    report.results[0]["verify"].update(nonfinite_run=run, nonfinite_reference=reference,
                                       nonfinite_parameter_here="layers.0.weight")
    assert report.equivalent is False
    text = str(report)
    assert "against single-process training: NOT compared, no difference can be measured: " + said in text
    assert "(rank 0's first: layers.0.weight)" in text and "equal within" not in text


# -- losses that are not finite (on_nonfinite) ------------------------------------------


def nonfinite_report(action, agreed=(), losses_at=None, steps=6):
    """A 4-rank fsdp report; ``agreed``: the steps the ranks agreed on; ``losses_at``: {rank: (step, value)}."""
    config = resolve(4, strategy="fsdp", model="mlp", steps=6, global_batch=32, on_nonfinite=action)
    results = []
    for rank in range(4):
        losses = replica_losses(rank)[:steps]
        if losses_at and rank in losses_at:
            step, value = losses_at[rank]
            losses[step] = value
        results.append(result(rank, {"dp": rank}, losses, steps=steps, nonfinite=list(agreed)))
    return TrainReport(config, results)


def test_a_run_stopped_at_a_nonfinite_loss_says_the_step_ranks_and_last_finite_loss_in_one_line():
    report = nonfinite_report("stop", agreed=[{"step": 4, "ranks": [1, 3], "values": ["nan", "inf"]}], steps=3)
    line = report.stop_line
    assert "\n" not in line
    assert line.startswith("the loss was nan on rank 1, inf on rank 3 at step 4: training stopped there on every "
                           "rank, before that step's update (last finite loss 1.8150 at step 3; the model is as "
                           "that step left it")
    assert "on_nonfinite='skip'" in line and report.nonfinite_line is None
    first = nonfinite_report("stop", agreed=[{"step": 1, "ranks": [0], "values": ["nan"]}], steps=0)
    assert "no step of this run had a finite loss; the model is as it was before the run" in first.stop_line


def test_skipped_steps_are_listed_in_the_report():
    report = nonfinite_report("skip", agreed=[{"step": 2, "ranks": [0], "values": ["nan"]},
                                              {"step": 5, "ranks": [0, 1], "values": ["nan", "nan"]}],
                              losses_at={0: (1, float("nan"))})
    assert report.stop_line is None
    assert "skipped the update of 2 steps whose loss was not finite: step 2, 5 (first: nan on rank 0)" in str(report)


def test_continue_warns_from_the_losses_the_ranks_kept():
    report = nonfinite_report("continue", losses_at={2: (3, float("-inf")), 1: (3, float("nan"))})
    assert report.stop_line is None
    assert report.nonfinite_line == (
        "warning: the loss was not finite in 1 step (4; first: nan on rank 1, -inf on rank 2 at step 4), and training "
        "went on (on_nonfinite='continue'): the model may hold NaN")
    assert nonfinite_report("continue").nonfinite_line is None
