"""Users' own data as batches: a map-style Dataset read as a stream of seeded epochs, or a function (step,
generator) -> batch. Every share a rank makes by itself, put together, is exactly the global batch one process
makes; the same seed gives the same batches; what cannot be read by step is refused, saying what to give.
Real Datasets and torch; no processes."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from labkit.zoo.configs import MLPConfig
from labkit.zoo.data import dataset_for
from labkit.torch_support.own_data import (
    DatasetBatches, GeneratedBatches, batch_share, batches_for, describe_data, mixed_seed,
)


class Tokens(Dataset):
    """Samples as dicts, the way a Hugging Face dataset gives them: sample i is the tokens i..i+3."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": torch.arange(index, index + 4), "labels": index % 3}


class Arrays(Dataset):
    """Samples as (numpy array, int)."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, index: int):
        return np.full(3, index, dtype=np.float32), index


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(5)


def numbered(length: int) -> TensorDataset:
    """Sample i is (i, 10 * i): every row says which sample it is."""
    return TensorDataset(torch.arange(length), torch.arange(length) * 10)


def make_batch(step, generator):
    return torch.randn(8, 3, generator=generator), torch.full((8,), step)


def assert_same(first, second):
    if isinstance(first, dict):
        assert list(first) == list(second)
        for key in first:
            assert_same(first[key], second[key])
    elif isinstance(first, (tuple, list)):
        assert type(first) is type(second) and len(first) == len(second)
        for one, other in zip(first, second):
            assert_same(one, other)
    else:
        assert torch.equal(first, second)


def joined(shares):
    """The shares put back together, row after row (the structure of the first)."""
    first = shares[0]
    if isinstance(first, dict):
        return {key: joined([share[key] for share in shares]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(joined([share[index] for share in shares]) for index in range(len(first)))
    return torch.cat(shares)


def test_every_epoch_reads_every_sample_once_in_a_new_order():
    batches = DatasetBatches(numbered(12), seed=5)
    epochs = [torch.cat([batches.batch(step, 4)[0] for step in range(3 * epoch, 3 * epoch + 3)]) for epoch in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(12))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    inputs, targets = batches.batch(4, 4)
    assert torch.equal(targets, inputs * 10)  # a sample's parts stay together


def test_an_epochs_order_is_drawn_once_and_kept():
    batches = DatasetBatches(numbered(12), seed=5)
    assert batches.order(0) is batches.order(0)
    assert sorted(batches.order(1)) == list(range(12))


def test_a_batch_across_an_epoch_boundary_ends_one_epoch_and_begins_the_next():
    batches = DatasetBatches(numbered(10), seed=2)
    inputs, _ = batches.batch(2, 4)  # stream positions 8..11: the last two of epoch 0, the first two of epoch 1
    assert inputs.tolist() == list(batches.order(0)[8:]) + list(batches.order(1)[:2])
    assert batches.epoch_of(2, 4) == pytest.approx(0.8)


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_the_shares_put_together_are_exactly_the_global_batch(parts):
    for dataset in (numbered(10), Tokens(10), Arrays()):
        batches, reference = DatasetBatches(dataset, seed=7), DatasetBatches(dataset, seed=7)
        for step in range(6):  # steps 2 and 4 span epoch boundaries for 10 samples, step 1 of 7 samples too
            whole = reference.batch(step, 8)
            shares = [batches.share(step, 8, index, parts) for index in range(parts)]
            assert_same(joined(shares), whole)


def test_a_share_fetches_only_its_own_samples():
    class Counting(Dataset):
        def __init__(self):
            self.fetched = []

        def __len__(self):
            return 20

        def __getitem__(self, index):
            self.fetched.append(index)
            return torch.tensor([index])

    dataset = Counting()
    share = DatasetBatches(dataset, seed=0).share(1, 8, 3, 4)
    assert len(dataset.fetched) == 2 and share.flatten().tolist() == dataset.fetched


def test_samples_are_collated_into_tensors():
    tokens = DatasetBatches(Tokens(10), seed=0).batch(0, 4)
    assert tokens["input_ids"].shape == (4, 4) and tokens["labels"].dtype == torch.int64
    assert torch.equal(tokens["input_ids"][:, 0] % 3, tokens["labels"])
    arrays, labels = DatasetBatches(Arrays(), seed=0).batch(0, 3)
    assert arrays.dtype == torch.float32 and arrays.shape == (3, 3)
    assert torch.equal(arrays[:, 0].long(), labels)


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    first, again, other = (DatasetBatches(numbered(50), seed) for seed in (3, 3, 4))
    for step in (0, 1, 9):
        assert torch.equal(first.batch(step, 16)[0], again.batch(step, 16)[0])
    assert not torch.equal(first.batch(0, 16)[0], other.batch(0, 16)[0])


def test_without_shuffle_every_epoch_is_the_datasets_own_order():
    batches = DatasetBatches(numbered(6), seed=3, shuffle=False)
    assert batches.batch(1, 4)[0].tolist() == [4, 5, 0, 1]


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="TensorDataset of 0 samples, is empty"):
        DatasetBatches(numbered(0), seed=0)


def test_a_generated_batch_depends_on_the_seed_and_step_only():
    first, again, other = (GeneratedBatches(make_batch, seed) for seed in (1, 1, 2))
    assert_same(first.batch(3, 8), again.batch(3, 8))
    assert not torch.equal(first.batch(3, 8)[0], first.batch(4, 8)[0])
    assert not torch.equal(first.batch(3, 8)[0], other.batch(3, 8)[0])
    assert_same(joined([first.share(3, 8, index, 4) for index in range(4)]), again.batch(3, 8))


def test_a_generated_batch_of_other_rows_than_the_global_batch_says_what_to_pass():
    batches = GeneratedBatches(lambda step, generator: (torch.zeros(64, 2), torch.zeros(64)), seed=0)
    with pytest.raises(ValueError) as refused:
        batches.batch(0, 32)
    assert str(refused.value) == ("your data function returned 64 rows for step 0; the run's global_batch is 32: "
                                  "pass global_batch=64 (or make the function return 32)")
    with pytest.raises(ValueError, match="batch of step 2: batch is a str, not a tensor"):
        GeneratedBatches(lambda step, generator: "no", seed=0).batch(2, 4)


def test_batches_for_reads_datasets_functions_and_factories():
    assert isinstance(batches_for(numbered(5), seed=0), DatasetBatches)
    assert isinstance(batches_for(make_batch, seed=0), GeneratedBatches)
    assert isinstance(batches_for(lambda: numbered(5), seed=0), DatasetBatches)
    assert isinstance(batches_for(lambda: make_batch, seed=0), GeneratedBatches)
    assert isinstance(batches_for(Arrays, seed=0), DatasetBatches)  # a class is a factory
    assert batches_for(numbered(5), seed=0, shuffle=False).batch(0, 5)[0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("data, words", [
    (Stream(), "Stream, gives samples one after another"),
    ((sample for sample in range(3)), "generator, gives samples one after another"),
    (DataLoader(numbered(4), batch_size=2), "DataLoader, gives samples one after another"),
    (lambda step: step, "is a function, but it takes 1 argument"),
    (lambda: (lambda: numbered(3)), "returned another function of no arguments"),
    (3, "your data is an int"),
])
def test_batches_for_refuses_what_cannot_be_read_by_step_saying_what_to_give(data, words):
    with pytest.raises(TypeError) as refused:
        batches_for(data, seed=0)
    message = str(refused.value)
    assert words in message
    assert "map-style" in message and "(step, generator)" in message and "e.g. data=" in message


def test_describe_data():
    assert describe_data(numbered(1797)) == "TensorDataset of 1,797 samples"
    assert describe_data(make_batch) == "function make_batch(step, generator)"
    assert describe_data(Arrays) == "class Arrays"
    assert describe_data(Stream()) == "a Stream"


def test_batch_share_cuts_the_zoos_data_and_uses_a_share_where_there_is_one():
    teacher = dataset_for("mlp", MLPConfig(dims=(4, 8, 2)), seed=1)
    assert_same(joined([batch_share(teacher, 2, 12, index, 3) for index in range(3)]), teacher.batch(2, 12))

    class SharesOnly:
        def batch(self, step, size):
            raise AssertionError("the whole batch was made")

        def share(self, step, size, index, parts):
            return torch.full((size // parts,), index)

    assert batch_share(SharesOnly(), 0, 8, 1, 2).tolist() == [1, 1, 1, 1]


def test_mixed_seeds_differ_for_neighbouring_seeds_streams_and_numbers():
    seeds = {mixed_seed(seed, stream, number) for seed in range(4) for stream in (1, 2) for number in range(50)}
    assert len(seeds) == 4 * 2 * 50
    assert all(0 <= seed < 2**64 for seed in seeds)
    assert mixed_seed(-1, 1, 0) == mixed_seed(-1, 1, 0)
