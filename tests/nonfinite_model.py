"""A tiny model, data and losses for the lab tests of losses that are NaN or infinite, or of the wrong kind.

Step ``BAD_STEP``'s batch (0-based) holds a NaN in row 5: on two data-parallel ranks of a global batch of 8,
rank 1's share. Imported by the ranks by name (the tests' folder is on their path)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BAD_STEP = 3


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 1)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def make_batch(step, generator):
    x = torch.randn(8, 4, generator=generator)
    y = torch.randn(8, 1, generator=generator)
    if step == BAD_STEP:
        x[5] = float("nan")
    return x, y


def all_finite(step, generator):
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def mse(output, batch):
    return F.mse_loss(output, batch[1])


def squared_errors(output, batch):
    return (output - batch[1]) ** 2  # one per sample: a vector, not a scalar


def as_float(output, batch):
    return float(F.mse_loss(output, batch[1]))
