"""The watch on a step's losses: each loss's code taken as it is made, the first one not finite told."""

import torch

from labkit.rank.nonfinite import FINITE, INFINITE, NAN, NEGATIVE_INFINITE, LossWatch
from labkit.torch_support.trainable import watched


def loss_of(value: float) -> torch.Tensor:
    weight = torch.ones((), requires_grad=True)
    return weight * value


def test_the_first_loss_not_finite_of_a_step_is_told_and_the_next_step_starts_clean():
    watch = LossWatch(torch.device("cpu"))
    for value in (1.0, float("inf"), float("nan")):  # a pipeline's micro-batches
        watch.saw(loss_of(value))
    assert watch.take(None) == INFINITE
    watch.saw(loss_of(-float("inf")))
    assert watch.take(None) == NEGATIVE_INFINITE
    watch.saw(loss_of(2.0))
    assert watch.take(None) == FINITE


def test_a_loss_no_gradient_flows_through_is_not_a_steps():
    # torch's pipeline schedule runs the loss on empty outputs to infer shapes, under no_grad: garbage values
    watch = LossWatch(torch.device("cpu"))
    watch.saw(torch.tensor(float("inf")))
    assert watch.take(loss_of(1.0)) == FINITE  # nothing seen: the step's own loss is read


def test_a_step_whose_losses_were_not_seen_reads_its_loss():
    watch = LossWatch(torch.device("cpu"))
    assert watch.take(torch.tensor(float("nan"))) == NAN
    assert watch.take(None) == FINITE  # a rank that computes no loss


def test_a_trainables_loss_is_shown_to_the_watch_only_while_one_is_set():
    class Holder:
        loss_watch = None

    holder, loss = Holder(), loss_of(float("nan"))
    assert watched(holder, loss) is loss
    holder.loss_watch = LossWatch(torch.device("cpu"))
    watched(holder, loss)
    assert holder.loss_watch.take(None) == NAN
