"""The watch on a step's losses: each loss's code taken as it is made, the first one not finite told."""

import pytest
import torch

from labkit.rank.nonfinite import FINITE, INFINITE, NAN, NEGATIVE_INFINITE, LossWatch, gradients_finite
from labkit.torch_support.trainable import watched

# A warning on a rank reaches the notebook's stderr at every step (float() of a loss that requires grad did)
pytestmark = pytest.mark.filterwarnings("error")


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


def test_a_loss_not_finite_marks_every_gradient_it_reaches_where_gradients_are_replicated():
    # an additive NaN leaves the gradient finite: the mark is what DDP's all-reduce carries to every rank
    weight = torch.ones(3, requires_grad=True)
    watch = LossWatch(torch.device("cpu"), poison=True)
    loss = (weight * 2).sum() + float("nan")
    watch.saw(loss)
    loss.backward()
    assert watch.take(None) == NAN
    assert not gradients_finite([weight.grad])


def test_gradients_are_finite_when_every_element_is():
    assert gradients_finite([torch.ones(4), torch.zeros(2, 2)]) and gradients_finite([])
    assert not gradients_finite([torch.ones(4), torch.tensor([1.0, float("inf")])])
    assert not gradients_finite([torch.tensor([float("nan")])])
