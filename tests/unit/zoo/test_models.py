"""Zoo models and data: splittable by stage with names kept, deterministic batches."""

import torch

from labkit.zoo.data import MarkovText, TeacherRegression
from labkit.zoo.configs import GPTConfig, MLPConfig
from labkit.zoo.models import build_model, stage_slice


def test_stage_slices_are_contiguous_and_cover_every_layer():
    names = [str(i) for i in range(5)]
    slices = [stage_slice(names, stage, 2) for stage in range(2)]
    assert slices == [["0", "1", "2"], ["3", "4"]]
    assert sum(slices, []) == names


def test_a_pipeline_stage_keeps_parameter_names():
    whole = build_model("gpt", GPTConfig(dim=16, heads=2, layers=4, seq=8), seed=3)
    names = dict(whole.named_parameters())
    stages = []
    for stage in range(2):
        part = build_model("gpt", GPTConfig(dim=16, heads=2, layers=4, seq=8), seed=3)
        part.keep_stage(stage, 2)
        stages.append(dict(part.named_parameters()))
    assert set(stages[0]) | set(stages[1]) == set(names)
    assert not set(stages[0]) & set(stages[1])
    assert "embed.tokens.weight" in stages[0] and "head.weight" in stages[1]
    for stage in stages:
        for name, tensor in stage.items():
            assert torch.equal(tensor, names[name])  # same seed, same weights


def test_stages_chain_to_the_whole_model():
    config = MLPConfig(dims=(8, 16, 16, 4))
    whole = build_model("mlp", config, seed=1)
    first, second = build_model("mlp", config, seed=1), build_model("mlp", config, seed=1)
    first.keep_stage(0, 2)
    second.keep_stage(1, 2)
    x = torch.randn(5, 8)
    assert torch.allclose(second(first(x)), whole(x))


def test_batches_depend_only_on_seed_and_step():
    text = MarkovText(vocab=16, seq=12, seed=7)
    inputs, targets = text.batch(step=3, size=4)
    again_inputs, _ = MarkovText(vocab=16, seq=12, seed=7).batch(step=3, size=4)
    assert torch.equal(inputs, again_inputs)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert not torch.equal(inputs, text.batch(step=4, size=4)[0])
    x, y = TeacherRegression(8, 4, seed=1).batch(0, 6)
    assert x.shape == (6, 8) and y.shape == (6, 4)


def test_markov_text_is_learnable():
    # Its entropy rate is far below log(vocab): there is structure for the GPT to find.
    text = MarkovText(vocab=64, seq=32, seed=0)
    p = text.transitions
    entropy = float(-(p * p.log()).sum(dim=1).mean())
    assert entropy < 0.5 * torch.log(torch.tensor(64.0)).item()
