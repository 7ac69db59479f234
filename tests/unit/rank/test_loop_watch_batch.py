"""What the loop watch reads from a batch: rows, and tokens only for 2-D integer data."""

import torch

from labkit.rank.instruments.loop_watch import batch_size


def test_the_first_tensor_gives_rows_and_integer_matrices_give_tokens():
    assert batch_size((torch.zeros(8, 3, 32, 32),), {}) == (8, None)
    assert batch_size((torch.zeros(4, 128, dtype=torch.long),), {}) == (4, 512)
    assert batch_size(("not a tensor", torch.zeros(6, 2)), {}) == (6, None)
    assert batch_size((), {"input_ids": torch.zeros(2, 10, dtype=torch.int32)}) == (2, 20)
    assert batch_size((torch.tensor(3.0),), {}) is None  # a scalar has no rows
    assert batch_size((torch.zeros(4, 4, dtype=torch.bool),), {}) == (4, None)  # a mask is not tokens
