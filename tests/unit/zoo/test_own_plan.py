"""A user's own network, spoken for by name: FSDP units, tensor-parallel plans, traced pipeline stages, and the
notebook's refusals of splits it cannot take (``zoo.own_plan``, ``zoo.own_checks``)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from labkit.zoo.own_plan import (
    ModulePlan, check_fsdp_units, check_pp_split, check_tp_plan, hf_tp_plan, largest_module_list, model_output,
    verify_refusal,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.head_dim = dim // heads

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        mixed = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = FeedForward(dim)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(nn.Module):
    """A user's transformer; the head also reads the embeddings, which skip every block."""

    def __init__(self, vocab: int = 30, dim: int = 16, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        embedded = self.embed(tokens)
        hidden = embedded
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden + embedded)


def cnn(dropout: float = 0.1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(dropout),
                         nn.Linear(4 * 6 * 6, 10))


def net(seed: int = 0, **sizes) -> Net:
    torch.manual_seed(seed)
    return Net(**sizes)


def tokens(rows: int = 2, seq: int = 8, vocab: int = 30) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


# -- FSDP units -----------------------------------------------------------------------------------------------------


def test_fsdp_units_default_to_the_largest_module_lists_children():
    model = net()
    assert ModulePlan(model).fsdp_units() == list(model.blocks)
    assert largest_module_list(model) == ("blocks", model.blocks)


def test_the_largest_module_list_is_counted_in_parameters_and_the_first_of_equals_wins():
    model = nn.Module()
    model.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)])
    model.big = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    model.twin = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert ModulePlan(model).fsdp_units() == list(model.big)


def test_a_model_without_a_module_list_is_one_unit():
    assert ModulePlan(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))).fsdp_units() == []
    assert largest_module_list(cnn()) is None


def test_named_units_are_the_outermost_matches_in_module_order_never_the_root():
    model = net()
    assert ModulePlan(model, fsdp_units=["Block", FeedForward]).fsdp_units() == list(model.blocks)
    assert ModulePlan(model, fsdp_units=[FeedForward]).fsdp_units() == [block.mlp for block in model.blocks]
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))), nn.Linear(2, 2))
    assert ModulePlan(outer, fsdp_units=[nn.Sequential]).fsdp_units() == [outer[0]]


def test_a_unit_class_the_model_lacks_is_refused_naming_the_classes_it_has():
    with pytest.raises(ValueError, match=r"fsdp_units names TransformerBlock, .*Block.*fsdp_units=\[\"Block\"\]"):
        ModulePlan(net(), fsdp_units=["TransformerBlock"]).fsdp_units()
    with pytest.raises(ValueError, match="names GRU"):
        check_fsdp_units(net(), [nn.GRU])
    check_fsdp_units(net(), ["Attention"])
    check_fsdp_units(net(), None)


# -- tensor-parallel plans ------------------------------------------------------------------------------------------


def test_style_names_become_torch_styles_and_replicated_entries_are_left_out():
    own = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = ModulePlan(net(), tp_plan={
        "blocks.*.attn.q": "colwise", "blocks.*.attn.out": "rowwise", "head": "colwise_gather_output",
        "blocks.*.mlp.up": "colwise_rep", "blocks.*.mlp.down": "rowwise_rep", "embed": "embedding_rowwise",
        "blocks.*.norm": "sequence", "blocks.0.attn": own, "blocks.1.mlp": "replicate",
    }).tp_plan()
    assert set(plan) == {"blocks.*.attn.q", "blocks.*.attn.out", "head", "blocks.*.mlp.up", "blocks.*.mlp.down",
                         "embed", "blocks.*.norm", "blocks.0.attn"}
    assert type(plan["blocks.*.attn.q"]) is ColwiseParallel and plan["blocks.*.attn.q"].output_layouts == (Shard(-1),)
    assert type(plan["blocks.*.attn.out"]) is RowwiseParallel
    assert plan["blocks.*.attn.out"].input_layouts == (Shard(-1),)
    assert type(plan["head"]) is ColwiseParallel and plan["head"].output_layouts == (Replicate(),)
    assert type(plan["blocks.*.mlp.up"]) is ColwiseParallel and plan["blocks.*.mlp.up"].output_layouts == (Replicate(),)
    assert type(plan["blocks.*.mlp.down"]) is RowwiseParallel
    assert plan["blocks.*.mlp.down"].input_layouts == (Replicate(),)
    assert type(plan["embed"]) is RowwiseParallel and plan["embed"].input_layouts == (Replicate(),)
    assert type(plan["blocks.*.norm"]) is SequenceParallel
    assert plan["blocks.0.attn"] is own
    assert ModulePlan(net(), tp_plan={"blocks.*.norm": "sequence"}).tp_plan(sequence_parallel=True)


def test_an_unknown_style_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r'"blocks.\*.attn.q" the style "columnwise".*colwise, .*rowwise'):
        ModulePlan(net(), tp_plan={"blocks.*.attn.q": "columnwise"}).tp_plan()
    with pytest.raises(ValueError, match='"columnwise"'):
        check_tp_plan(net(), {"blocks.*.attn.q": "columnwise"}, 2)


def test_no_plan_on_a_rank_is_refused_with_the_rule_in_words():
    # The notebook refuses first, with a plan tried on the meta device (torch_support.tp_trial); a rank has no sample to
    # try one on, so it suggests none it has not tried.
    with pytest.raises(ValueError) as refused:
        ModulePlan(net()).tp_plan()
    assert str(refused.value) == ('tp needs a plan for this model: pass tp_plan={"<the Linear layers that read a '
                                  'block\'s input>": "colwise", "<the Linear layer that reads their outputs>": '
                                  '"rowwise"}')


def test_a_pattern_that_names_no_module_is_refused_with_the_names_near_it():
    with pytest.raises(ValueError, match=r'"blocks.\*.attn.query".*blocks.0.attn.q, blocks.0.attn.out'):
        ModulePlan(net(), tp_plan={"blocks.*.attn.query": "colwise"}).tp_plan()
    with pytest.raises(ValueError, match=r'"blocks.attn.q"'):
        check_tp_plan(net(), {"blocks.attn.q": "colwise"}, 2)


def test_sequence_parallel_needs_the_plan_to_shard_something_by_sequence():
    with pytest.raises(ValueError, match='sequence_parallel for your own model comes from its plan'):
        ModulePlan(net(), tp_plan={"blocks.*.attn.q": "colwise"}).tp_plan(sequence_parallel=True)


def test_a_hugging_face_model_publishes_its_plan_with_embeddings_and_head_kept_whole(llama):
    plan = hf_tp_plan(llama)
    assert plan is not None
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan and "model.embed_tokens" not in plan
    styles = ModulePlan(llama).tp_plan()
    assert set(styles) == set(plan)
    assert type(styles["model.layers.*.mlp.gate_proj"]) is ColwiseParallel
    check_tp_plan(llama, plan, 2)
    with pytest.raises(ValueError, match=r"tp=3 does not divide model.layers.0.self_attn.q_proj \(Linear\)"):
        check_tp_plan(llama, plan, 3)


def test_a_base_model_plan_in_the_config_is_prefixed_with_the_base_models_name():
    class Config:
        base_model_tp_plan = {"layers.*.up": "colwise", "embed": "embedding_rowwise"}

    class Wrapper(nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.config = Config()
            self.model = nn.Module()
            self.model.embed = nn.Embedding(8, 4)
            self.model.layers = nn.ModuleList([nn.Sequential()])
            self.model.layers[0].up = nn.Linear(4, 8)

    assert hf_tp_plan(Wrapper()) == {"model.layers.*.up": "colwise"}
    assert hf_tp_plan(net()) is None
    assert hf_tp_plan(nn.Linear(2, 2)) is None


# -- the notebook's checks of a plan --------------------------------------------------------------------------------


def test_check_tp_plan_reads_the_split_width_of_each_matched_layer_on_the_meta_device():
    with torch.device("meta"):
        model = net(vocab=30)
    plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.out": "rowwise", "blocks.*.mlp.up": "colwise"}
    check_tp_plan(model, plan, 4)
    with pytest.raises(ValueError) as refused:
        check_tp_plan(model, plan, 3)
    assert "tp=3 does not divide blocks.0.attn.q (Linear): its colwise split cuts out_features=16" in str(refused.value)
    with pytest.raises(ValueError, match=r"blocks.0.mlp.down \(Linear\): its rowwise split cuts in_features=32"):
        check_tp_plan(model, {"blocks.*.mlp.down": "rowwise"}, 3)
    with pytest.raises(ValueError, match=r"embed \(Embedding\): its rowwise split cuts num_embeddings=30"):
        check_tp_plan(model, {"embed": "embedding_rowwise"}, 4)
    with pytest.raises(ValueError, match=r"embed \(Embedding\): its colwise split cuts embedding_dim=16"):
        check_tp_plan(model, {"embed": "colwise"}, 3)
    with pytest.raises(ValueError, match=r"blocks.0.attn is a Attention: colwise and rowwise split nn.Linear"):
        check_tp_plan(model, {"blocks.*.attn": RowwiseParallel()}, 2)
    check_tp_plan(model, {"blocks.*.norm": "sequence", "blocks.*.attn": "replicate"}, 3)


def test_check_pp_split_refuses_each_wrong_list_naming_what_to_pass():
    model = net()
    check_pp_split(model, ["blocks.1", "blocks.3"], 3)
    check_pp_split(model, None, 1)
    with pytest.raises(ValueError, match=r'pp needs split points for this model: pass pp_split=\["blocks.2"\], or'):
        check_pp_split(model, None, 2)
    with pytest.raises(ValueError, match=r'"layers.2", which is no module.*blocks.0, blocks.1, blocks.2, blocks.3'):
        check_pp_split(model, ["layers.2"], 2)
    with pytest.raises(ValueError, match=r'pp=3 needs 2 split points, pp_split has 1: e.g. pp_split=\["blocks.1", '):
        check_pp_split(model, ["blocks.2"], 3)
    with pytest.raises(ValueError, match=r'"blocks.1" comes before "blocks.3"; pass pp_split=\["blocks.1", "blocks.3"'):
        check_pp_split(model, ["blocks.3", "blocks.1"], 3)
    with pytest.raises(ValueError, match=r'the whole model \(""\)'):
        check_pp_split(model, [""], 2)
    with pytest.raises(ValueError, match='"blocks.2" twice'):
        check_pp_split(model, ["blocks.2", "blocks.2"], 3)


def test_a_sequential_models_split_points_are_its_children():
    with pytest.raises(ValueError, match=r'pp_split=\["1"\]'):
        check_pp_split(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), None, 2)


# -- pipeline stages cut by tracing ---------------------------------------------------------------------------------


def chain(parts, *inputs):
    output = inputs
    for part in parts:
        output = part(*output)
        output = output if isinstance(output, tuple) else (output,)
    return output[0] if len(output) == 1 else output


@pytest.fixture(scope="module")
def two_stages():
    """A Net, its input, and its two stages cut before blocks.2 (one trace for the tests that read them)."""
    model, x = net(), tokens()
    plan = ModulePlan(model, pp_split=["blocks.2"], example_inputs=(x,))
    return model, x, [plan.split_stage(stage, 2) for stage in range(2)]


def test_two_traced_stages_chain_to_the_whole_model_and_keep_parameter_names(two_stages):
    model, x, parts = two_stages
    first = {name for name, _ in parts[0].named_parameters()}
    assert "embed.weight" in first and "blocks.1.mlp.down.bias" in first and "blocks.2.norm.weight" not in first
    assert {name for name, _ in parts[1].named_parameters()} >= {"blocks.2.norm.weight", "head.weight"}
    assert torch.equal(chain(parts, x), model(x))
    # The original Linear layers are back in the stage (what torch's tp styles accept), with the same parameters.
    assert parts[0].get_submodule("blocks.0.attn.q") is model.blocks[0].attn.q
    assert parts[1].get_parameter("head.weight") is model.head.weight
    assert "forward" not in vars(model.blocks[2])  # torch's split marker is taken off again
    assert torch.equal(model(x), chain(parts, x))


def test_three_traced_stages_carry_a_skip_connection_through_the_middle_one():
    model, x = net(layers=3), tokens()
    plan = ModulePlan(model, pp_split=["blocks.1", "blocks.2"], example_inputs=(x,))
    parts = [plan.split_stage(stage, 3) for stage in range(3)]
    middle = parts[1](*parts[0](x))
    assert isinstance(middle, tuple) and len(middle) == 2  # the hidden state, and the embeddings it carries on
    assert torch.allclose(parts[2](*middle), model(x), atol=1e-6)


def test_a_plan_made_for_a_stage_speaks_for_what_the_stage_holds(two_stages):
    _, _, parts = two_stages
    first = ModulePlan(parts[0], fsdp_units=["Block"], tp_plan={"blocks.*.attn.q": "colwise", "head": "colwise_rep"})
    assert first.fsdp_units() == [parts[0].get_submodule("blocks.0"), parts[0].get_submodule("blocks.1")]
    assert set(first.tp_plan()) == {"blocks.*.attn.q"}  # the head is the last stage's
    last = ModulePlan(parts[1])
    assert last.fsdp_units() == [parts[1].get_submodule("blocks.2"), parts[1].get_submodule("blocks.3")]
    with pytest.raises(ValueError, match='"blocks.*.attn.query"'):
        ModulePlan(parts[1], tp_plan={"blocks.*.attn.query": "colwise"}).tp_plan()


def test_a_traced_hugging_face_model_passes_several_tensors_and_its_output_is_rebuilt(llama):
    x = tokens(vocab=128)
    plan = ModulePlan(llama, pp_split=["model.layers.1"], example_inputs=(x,))
    first, last = plan.split_stage(0, 2), plan.split_stage(1, 2)
    passed = first(x)
    assert isinstance(passed, tuple) and len(passed) > 1  # hidden states, rotary tables, the attention mask
    logits = last(*passed)
    assert isinstance(logits, torch.Tensor)  # the pipeline passes tensors only
    assert torch.allclose(model_output(last, logits).logits, llama(x).logits, atol=1e-5)
    assert model_output(first, passed) is passed
    assert set(ModulePlan(last).tp_plan()) == set(hf_tp_plan(llama))  # the plan the whole model published


def test_a_split_without_split_points_or_example_is_refused_saying_what_to_pass():
    with pytest.raises(ValueError, match=r'pass pp_split=\["blocks.2"\], or give the model a keep_stage'):
        ModulePlan(net(), example_inputs=(tokens(),)).split_stage(0, 2)
    with pytest.raises(ValueError, match=r"pp=2 needs 1 split points, pp_split has 2"):
        ModulePlan(net(), pp_split=["blocks.1", "blocks.2"], example_inputs=(tokens(),)).split_stage(0, 2)
    with pytest.raises(ValueError, match="tracing its forward on an example micro-batch, and there is none"):
        ModulePlan(net(), pp_split=["blocks.2"]).split_stage(0, 2)


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.export cannot follow it
            return self.blocks[1](self.blocks[0](x))
        return self.blocks[0](x)


class EarlyOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        first = self.blocks[0](x)
        return self.blocks[1](first), first


class LateInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, bias):
        return self.blocks[1](self.blocks[0](x)) + bias


def test_what_the_tracer_cannot_cut_is_refused_naming_the_alternative():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"pp traces the forward with torch.export to cut it, and the trace failed: "
                                         r".*data-dependent.*keep_stage\(stage, stages\)"):
        ModulePlan(Branching(), pp_split=["blocks.1"], example_inputs=(x,)).split_stage(0, 2)
    with pytest.raises(ValueError, match="returns a value that an earlier pipeline stage computes"):
        ModulePlan(EarlyOutput(), pp_split=["blocks.1"], example_inputs=(x,)).split_stage(0, 2)
    with pytest.raises(ValueError, match="reads the model's input bias that the first stage does not take"):
        ModulePlan(LateInput(), pp_split=["blocks.1"], example_inputs=(x, torch.randn(3, 4))).split_stage(1, 2)


class KeyValueCache:
    """What a Hugging Face model returns beside its logits while its config says use_cache: no tensor."""


class Settings:
    def __init__(self) -> None:
        self.use_cache = True


class CachingNet(nn.Module):
    """A Hugging Face-like model: it returns its cache with its output unless its config says use_cache=False."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.generation_config = Settings(), Settings()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        out = self.blocks[1](self.blocks[0](x))
        return (out, KeyValueCache()) if self.config.use_cache else out


def test_a_model_that_returns_its_cache_is_traced_without_it_and_its_configs_are_left_as_they_were():
    model, x = CachingNet(), torch.randn(3, 4)
    plan = ModulePlan(model, pp_split=["blocks.1"], example_inputs=(x,))
    first, last = plan.split_stage(0, 2), plan.split_stage(1, 2)
    assert torch.allclose(last(first(x)), model.blocks[1](model.blocks[0](x)))
    assert model.config.use_cache is True and model.generation_config.use_cache is True


def test_a_llama_of_a_default_config_is_cut_into_stages():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert config.use_cache  # the default: the model returns its key/value cache
    torch.manual_seed(0)
    model, x = transformers.LlamaForCausalLM(config), tokens(vocab=128)
    plan = ModulePlan(model, pp_split=["model.layers.1"], example_inputs=(x,))
    first, last = plan.split_stage(0, 2), plan.split_stage(1, 2)
    assert torch.allclose(model_output(last, last(*first(x))).logits, model(x).logits, atol=1e-5)
    assert config.use_cache


# -- why verify cannot hold -----------------------------------------------------------------------------------------


def test_verify_is_refused_for_dropout_and_under_data_parallelism_for_batch_norm():
    refusal = verify_refusal(cnn(dropout=0.1), data_parallel=False)
    assert refusal == ("dropout at 4 (p=0.1) draws other masks on each rank than in one process: build the model "
                       "with p=0 to verify")
    assert verify_refusal(cnn(dropout=0.0), data_parallel=False) is None
    refusal = verify_refusal(cnn(dropout=0.0), data_parallel=True)
    assert refusal is not None and refusal.startswith("batch norm at 1 (BatchNorm2d)")
    assert verify_refusal(net(), data_parallel=True) is None


def test_verify_is_refused_for_a_hugging_face_configs_dropout(llama):
    assert verify_refusal(llama, data_parallel=True) is None
    llama.config.attention_dropout = 0.1
    try:
        refusal = verify_refusal(llama, data_parallel=False)
    finally:
        llama.config.attention_dropout = 0.0
    assert refusal is not None and "attention_dropout=0.1" in refusal
