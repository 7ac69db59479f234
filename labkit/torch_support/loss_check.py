"""A loss function's result, checked where it is made: one number for the batch, as a tensor gradients flow through.

Without the check a loss of the wrong kind fails inside torch's backward with
torch's words, which name neither the loss nor what to return: a vector ("grad
can be implicitly created only for scalar outputs"), a Python float
("'float' object has no attribute 'backward'"), a tensor cut from the
gradients ("element 0 of tensors does not require grad"). Checking costs a look
at the result's type and shape, never its value, so it runs at every step.
"""

from __future__ import annotations

from typing import Any

import torch

SCALAR_EXAMPLE = "e.g. F.mse_loss(output, target), or ((output - target) ** 2).mean()"


def _kind(value: Any) -> str:
    """What a wrong result is, for the message: 'a float', 'None', 'a tuple'."""
    if value is None:
        return "None"
    return f"a {type(value).__name__}"  # not its value: it differs by rank, and one message tells all ranks


def checked_loss(value: Any, who: str) -> torch.Tensor:
    """``value``, what ``who`` returned ("your loss function (mse)"), as a 0-d tensor; else a TypeError saying
    what to return instead."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{who} returned {_kind(value)}, not a tensor: return a scalar tensor computed from "
                        f"the output ({SCALAR_EXAMPLE}); float(...) and .item() cut it from the gradients")
    if value.numel() != 1:
        raise TypeError(f"{who} returned a tensor of shape {tuple(value.shape)}, not a scalar: return one "
                        f"number for the batch, e.g. its mean (loss.mean())")
    if torch.is_grad_enabled() and not value.requires_grad:
        raise TypeError(f"{who} returned a tensor no gradient flows through: compute it from the model's "
                        f"output without .detach() or torch.no_grad() ({SCALAR_EXAMPLE})")
    return value.reshape(()) if value.dim() else value
