"""Batches of any nesting (tuples, lists, dicts, namedtuples of tensors): flattened and rebuilt, checked with
errors that name the leaf at fault, cut into rows, moved, given to a model, and scored by the default loss
(cross-entropy on class ids). Real tensors and modules; no processes."""

import collections
import types

import pytest
import torch
from torch import nn

from labkit.torch_support.batches import (
    call_model, check_batch, chunk_rows, default_loss, flatten, model_call, take_rows, targets_of, to_device,
    tokens_per_sample,
)
from labkit.torch_support.host_staging import NoFence, PinnedStaging

Pair = collections.namedtuple("Pair", ["image", "mask"])


def nested_batch(rows: int = 6) -> dict:
    numbers = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    return {
        "inputs": (numbers, [torch.arange(rows), Pair(image=numbers * 2, mask=torch.ones(rows, 2, dtype=torch.bool))]),
        "labels": torch.arange(rows) % 2,
    }


def test_flatten_gives_the_leaves_in_order_and_rebuilds_every_container_of_its_own_type():
    batch = nested_batch()
    leaves, rebuild = flatten(batch)
    expected = [batch["inputs"][0], batch["inputs"][1][0], batch["inputs"][1][1].image, batch["inputs"][1][1].mask,
                batch["labels"]]
    assert len(leaves) == 5 and all(leaf is want for leaf, want in zip(leaves, expected))

    rebuilt = rebuild([leaf + 1 for leaf in leaves])
    assert list(rebuilt) == ["inputs", "labels"] and type(rebuilt) is dict
    assert type(rebuilt["inputs"]) is tuple and type(rebuilt["inputs"][1]) is list
    assert type(rebuilt["inputs"][1][1]) is Pair
    assert torch.equal(rebuilt["inputs"][1][1].image, batch["inputs"][1][1].image + 1)
    assert torch.equal(rebuilt["labels"], batch["labels"] + 1)
    with pytest.raises(ValueError, match="5 tensors; 4 were given"):
        rebuild(leaves[:4])


def test_flatten_keeps_an_ordered_dicts_type_and_key_order():
    batch = collections.OrderedDict([("b", torch.zeros(2)), ("a", torch.ones(2))])
    leaves, rebuild = flatten(batch)
    assert [float(leaf[0]) for leaf in leaves] == [0.0, 1.0]
    rebuilt = rebuild(leaves)
    assert type(rebuilt) is collections.OrderedDict and list(rebuilt) == ["b", "a"]


def test_a_single_tensor_is_a_batch_of_one_leaf():
    tensor = torch.randn(4, 2)
    leaves, rebuild = flatten(tensor)
    assert leaves == [tensor] and rebuild(leaves) is tensor
    assert check_batch(tensor, "x") == 4


def test_check_batch_counts_the_rows():
    assert check_batch(nested_batch(6), "your data's sample 0") == 6


def test_check_batch_names_a_leaf_that_is_not_a_tensor_with_its_path_and_type():
    with pytest.raises(TypeError, match=r'your data\'s sample 0: batch\["labels"\] is a str, not a tensor'):
        check_batch({"x": torch.zeros(2, 3), "labels": "cat"}, "your data's sample 0")
    with pytest.raises(TypeError, match=r"my batch: batch\[1\]\[0\] is an int"):
        check_batch((torch.zeros(2), [3]), "my batch")
    with pytest.raises(TypeError, match=r"a batch: batch\.mask\[0\] is an int"):
        flatten(Pair(image=torch.zeros(2), mask=[1, 2]))


def test_check_batch_refuses_a_0d_tensor_and_first_dimensions_that_differ():
    with pytest.raises(ValueError, match=r"step 3: batch\[1\] is a 0-d tensor"):
        check_batch((torch.zeros(4, 2), torch.tensor(1)), "step 3")
    with pytest.raises(ValueError, match=r'batch\["labels"\] has 5 rows but batch\["x"\] has 4'):
        check_batch({"x": torch.zeros(4, 2), "labels": torch.zeros(5)}, "step 3")
    with pytest.raises(ValueError, match="holds no tensors"):
        check_batch((), "step 3")


def test_take_rows_and_chunk_rows_keep_the_structure():
    batch = nested_batch(6)
    middle = take_rows(batch, 2, 5)
    assert check_batch(middle, "x") == 3
    assert torch.equal(middle["inputs"][1][1].image, batch["inputs"][1][1].image[2:5])
    parts = chunk_rows(batch, 3)
    assert [check_batch(part, "x") for part in parts] == [2, 2, 2]
    assert torch.equal(torch.cat([part["labels"] for part in parts]), batch["labels"])
    assert torch.equal(torch.cat([part["inputs"][0] for part in parts]), batch["inputs"][0])


def test_chunk_rows_refuses_rows_that_do_not_divide():
    with pytest.raises(ValueError, match="6 rows does not split into 4 equal parts"):
        chunk_rows(nested_batch(6), 4)


def test_to_device_calls_the_mover_once_with_every_tensor():
    calls = []

    def mover(tensors):
        calls.append(len(tensors))
        return tuple(tensor.clone() for tensor in tensors)

    batch = nested_batch(4)
    moved = to_device(batch, mover)
    assert calls == [5]
    assert type(moved["inputs"][1][1]) is Pair
    assert torch.equal(moved["inputs"][0], batch["inputs"][0])
    assert moved["inputs"][0].data_ptr() != batch["inputs"][0].data_ptr()


def test_to_device_goes_through_the_loops_staging():
    staging = PinnedStaging(torch.device("cpu"), allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype),
                            fence=NoFence)
    batch = {"input_ids": torch.arange(12).reshape(3, 4)[:, 1:], "labels": torch.arange(3)}  # a strided view
    moved = to_device(batch, staging.to_device)
    assert torch.equal(moved["input_ids"], batch["input_ids"]) and moved["input_ids"].is_contiguous()
    assert torch.equal(moved["labels"], batch["labels"])


def test_model_call_and_call_model():
    inputs, targets = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    assert model_call(inputs) == ((inputs,), {})
    args, kwargs = model_call((inputs, targets))
    assert args[0] is inputs and kwargs == {}
    args, kwargs = model_call([inputs, targets, targets])
    assert args[0] is inputs and kwargs == {}
    args, kwargs = model_call({"input_ids": inputs, "labels": targets})
    assert args == () and kwargs["input_ids"] is inputs and kwargs["labels"] is targets

    linear = nn.Linear(3, 2)
    assert torch.equal(call_model(linear, (inputs, targets)), linear(inputs))

    class Keywords(nn.Module):
        def forward(self, input_ids, labels=None):
            return input_ids.sum() + labels.sum()

    assert float(call_model(Keywords(), {"input_ids": inputs, "labels": targets})) == pytest.approx(
        float(inputs.sum() + targets.sum()))


def test_inputs_that_are_a_tuple_or_a_dict_are_spread_over_the_models_arguments():
    first, second, targets = torch.randn(4, 3), torch.randn(4, 3), torch.tensor([0, 1, 0, 1])

    class TwoInputs(nn.Module):
        def forward(self, a, b):
            return a - b

    assert torch.equal(call_model(TwoInputs(), ((first, second), targets)), first - second)
    assert torch.equal(call_model(TwoInputs(), ([first, second], targets)), first - second)
    assert torch.equal(call_model(TwoInputs(), ({"b": second, "a": first}, targets)), first - second)
    assert targets_of(((first, second), targets)) is targets
    Pair = collections.namedtuple("Pair", "x y")  # a named tuple is one input, as the model defines it
    args, _ = model_call((Pair(first, second), targets))
    assert len(args) == 1 and args[0].x is first


def test_targets_of():
    inputs, targets = torch.randn(4, 3), torch.arange(4)
    assert targets_of((inputs, targets)) is targets
    assert targets_of([inputs, targets, inputs]) is targets
    for key in ("labels", "targets", "target"):
        assert targets_of({"x": inputs, key: targets}) is targets
    with pytest.raises(ValueError, match="no targets.*loss=lambda output, batch"):
        targets_of((inputs,))
    with pytest.raises(ValueError, match="'labels', 'targets' or 'target'"):
        targets_of({"x": inputs})
    with pytest.raises(ValueError, match="single Tensor"):
        targets_of(inputs)


def test_default_loss_on_class_ids_per_sample():
    logits, labels = torch.randn(5, 7), torch.tensor([0, 6, 3, 3, 1])
    assert torch.allclose(default_loss(logits, (torch.zeros(5, 2), labels)),
                          nn.functional.cross_entropy(logits, labels))
    # A tuple output: its first element is the logits.
    assert torch.allclose(default_loss((logits, "extra"), (None, labels)), nn.functional.cross_entropy(logits, labels))


def test_default_loss_on_class_ids_per_token_and_ignoring_minus_100():
    logits, labels = torch.randn(2, 4, 9), torch.randint(9, (2, 4), dtype=torch.int32)
    expected = nn.functional.cross_entropy(logits.reshape(8, 9), labels.reshape(8).long())
    assert torch.allclose(default_loss(logits, (labels, labels)), expected)
    labels[0, :2] = -100
    kept = labels.reshape(8) != -100
    expected = nn.functional.cross_entropy(logits.reshape(8, 9)[kept], labels.reshape(8)[kept].long())
    assert torch.allclose(default_loss(logits, (labels, labels)), expected)


def test_default_loss_reads_a_hugging_face_style_output_and_a_dicts_labels():
    logits, labels = torch.randn(3, 5, 11), torch.randint(11, (3, 5))
    output = types.SimpleNamespace(logits=logits, loss=None)
    expected = nn.functional.cross_entropy(logits.reshape(15, 11), labels.reshape(15))
    assert torch.allclose(default_loss(output, {"input_ids": labels, "labels": labels}), expected)


def test_default_loss_refuses_float_targets_and_shapes_that_do_not_fit_saying_to_pass_a_loss():
    with pytest.raises(ValueError, match=r"cross-entropy on class ids.*torch.float32 targets of shape \(4, 2\).*"
                                         r"loss=lambda output, batch: torch.nn.functional.mse_loss"):
        default_loss(torch.randn(4, 2), (torch.randn(4, 3), torch.randn(4, 2)))
    with pytest.raises(ValueError, match=r"torch.int64 targets of shape \(4, 3\) and logits of shape \(4, 5\)"):
        default_loss(torch.randn(4, 5), (torch.randn(4, 3), torch.zeros(4, 3, dtype=torch.long)))
    with pytest.raises(TypeError, match="no tensor of logits"):
        default_loss({"logits": torch.randn(4, 5)}, (torch.randn(4, 3), torch.zeros(4, dtype=torch.long)))


def test_tokens_per_sample():
    ids = torch.randint(50, (4, 16))
    assert tokens_per_sample((ids, ids)) == 16
    assert tokens_per_sample(ids) == 16
    assert tokens_per_sample({"input_ids": ids, "attention_mask": torch.ones(4, 16)}) == 16
    assert tokens_per_sample((ids.float(), ids)) is None
    assert tokens_per_sample((torch.arange(4), ids)) is None
    assert tokens_per_sample((ids.reshape(4, 4, 4), ids)) is None
    assert tokens_per_sample({"pixel_values": ids}) is None
