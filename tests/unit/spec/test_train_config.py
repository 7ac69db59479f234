"""Training requests are checked before any rank works: pure, no processes."""

import re

import pytest

from labkit.spec.train_config import parse_strategy, resolve


def test_strategies_and_their_axes():
    assert parse_strategy("fsdp+tp") == ("fsdp", "tp")
    assert resolve(4, strategy="fsdp").mesh.describe() == "dp=4"
    assert resolve(4, strategy="pp", micro_batches=4).mesh.describe() == "pp=4"
    config = resolve(4, strategy="pp+tp", model="gpt", mesh=dict(pp=2, tp=2), micro_batches=2)
    assert (config.axis("pp"), config.axis("tp"), config.axis("dp")) == (2, 2, 1)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(strategy="zero3"), "unknown strategy"),
        (dict(strategy="ddp+fsdp", mesh=dict(dp=4)), "choose one of them"),
        (dict(strategy="tp+tp"), "names a part twice"),
        (dict(strategy="fsdp+tp", mesh=dict(dp=2, pp=2)), "uses mesh axes dp, tp"),
        (dict(strategy="fsdp+tp", mesh=dict(dp=3, tp=2)), "must multiply to 4"),
        (dict(strategy="ddp", global_batch=30), "split evenly into 4 data-parallel replicas"),
        (dict(strategy="ddp", steps=0), "steps must be a positive integer"),
        (dict(strategy="pp", micro_batches=2), "micro_batches=2 is fewer than the 4 stages"),
        (dict(strategy="pp", model="gpt", model_settings=dict(layers=2), micro_batches=4), "at least 4 layers"),
        (dict(strategy="tp", model="gpt", model_settings=dict(heads=2, dim=32)), "divide the number of attention heads"),
        (dict(strategy="tp", model="gpt", sequence_parallel=True, model_settings=dict(seq=30)), "sequence length"),
        (dict(strategy="ddp", sequence_parallel=True), "add tp to the strategy"),
        (dict(strategy="ddp", model="resnet"), "unknown model"),
        (dict(strategy="ddp", model="gpt", model_settings=dict(width=3)), "no setting width"),
        (dict(strategy="ddp", optimizer="lamb"), "unknown optimizer"),
        (dict(strategy="ddp", max_memory="lots"), "written like 64MB"),
        (dict(strategy="ddp", precision="fp16"), "unknown precision"),
        (dict(strategy="ddp", precision="bf16", verify=True), "strict float32"),
        (dict(strategy="ddp", tf32=True, verify=True), "strict float32"),
        (dict(strategy="ddp", peak_tflops=-1), "peak_tflops"),
        (dict(strategy="ddp", peak_tflops=True), "peak_tflops"),
        (dict(strategy="pp+tp", model="gpt", model_settings=dict(heads=3, dim=48, layers=1)), "no split of 4 ranks"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(settings, message):
    with pytest.raises(ValueError, match=message):
        resolve(4, **settings)


def test_too_few_microbatches_for_1f1b_say_what_to_pass_not_another_lab_size():
    with pytest.raises(ValueError) as refused:
        resolve(4, strategy="pp", model="gpt", micro_batches=1)
    said = str(refused.value)
    assert "pass micro_batches=4 or more (left out, it is the number of stages), or schedule='gpipe'" in said
    assert "run on a lab of" not in said


def test_defaults_that_run():
    from labkit.spec.mesh import MeshSpec
    from labkit.spec.train_config import even_splits

    assert resolve(4, strategy="pp").micro_batches == 4  # 1F1B needs at least one per stage
    assert resolve(4, strategy="ddp").micro_batches == 1
    assert resolve(4, strategy="ddp+pp").micro_batches == 2
    config = resolve(4, strategy="fsdp+tp", model="gpt")
    assert config.mesh.describe() == "dp=2 x tp=2" and config.mesh_reason.startswith("the most even split")
    lab_mesh = MeshSpec(("tp", "dp"), (2, 2))
    assert resolve(4, strategy="fsdp+tp", lab_mesh=lab_mesh).mesh_reason == "the lab's mesh"
    assert resolve(4, strategy="ddp", lab_mesh=lab_mesh).mesh.describe() == "dp=4"  # a single axis takes all ranks
    assert resolve(4, strategy="fsdp+tp", mesh=dict(dp=2, tp=2)).mesh_reason == "given"
    # The most even split the model allows: 8 heads cannot take tp=4 x dp=2's sibling with tp=8.
    assert even_splits(8, 2) == [(2, 4), (4, 2)] and even_splits(2, 2) == []
    with pytest.raises(ValueError, match="cannot be split over 2 axes"):
        resolve(2, strategy="fsdp+tp")


def test_the_defaults_run_on_any_lab_size_or_name_the_nearest_that_does():
    from labkit.strategies.catalog import compositions

    for strategy in sorted(set(compositions(8)) | set(compositions(1))):
        for model in ("mlp", "gpt"):
            for ranks in range(1, 9):
                try:
                    config = resolve(ranks, strategy=strategy, model=model)
                except ValueError as error:
                    sizes = re.search(r"run on a lab of (\d+)(?: or (\d+))? ranks, the nearest size", str(error))
                    assert sizes, f"{strategy} {model} on {ranks} ranks: {error}"
                    for size in filter(None, sizes.groups()):
                        assert abs(int(size) - ranks) >= 1
                        resolve(int(size), strategy=strategy, model=model)  # the size named works
                    continue
                assert config.global_batch % (config.data_parts * config.micro_batches) == 0
                assert abs(config.global_batch - 32) < config.data_parts * config.micro_batches


def test_the_default_batch_is_rounded_and_says_so_a_given_one_is_refused_with_the_nearest():
    assert resolve(3, strategy="ddp").global_batch == 33
    assert resolve(3, strategy="ddp").batch_note == "global batch 33 (32 rounded up to a multiple of 3 data-parallel ranks)"
    assert resolve(4, strategy="ddp").batch_note == ""
    assert resolve(6, strategy="ddp+pp").batch_note.endswith("multiple of 3 data-parallel ranks x 2 micro-batches)")
    with pytest.raises(ValueError, match="use a multiple of 3, such as 30 or 33$"):
        resolve(3, strategy="ddp", global_batch=32)
    with pytest.raises(ValueError, match="pp=5 stages need at least 5 layers.*run on a lab of 4 ranks"):
        resolve(5, strategy="pp")
    with pytest.raises(ValueError, match="tp=3 must divide.*run on a lab of 2 or 4 ranks"):
        resolve(3, strategy="tp")


def test_on_nonfinite_is_one_of_its_actions_and_may_change_on_resume():
    with pytest.raises(ValueError, match=r"on_nonfinite is one of 'stop', 'skip', 'continue' .*on_nonfinite='skip'"):
        resolve(4, strategy="ddp", on_nonfinite="ignore")
    assert resolve(4, strategy="ddp").on_nonfinite == "stop"
    from labkit.spec.train_config import resume_differences

    assert resume_differences(resolve(4, strategy="ddp"), resolve(4, strategy="ddp", on_nonfinite="skip")) == []
