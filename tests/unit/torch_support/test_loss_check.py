"""A loss function's result of the wrong kind is named, with what to return, before torch's backward fails on it."""

import pytest
import torch

from labkit.torch_support.loss_check import checked_loss

WHO = "your loss function (vector)"


def test_a_vector_names_the_loss_its_shape_and_the_mean():
    output = torch.ones(8, 1, requires_grad=True)
    with pytest.raises(TypeError, match=r"your loss function \(vector\) returned a tensor of shape \(8, 1\), not a "
                                        r"scalar: .*loss.mean\(\)"):
        checked_loss(output * 2, WHO)


@pytest.mark.parametrize("value, kind", [(0.93, "a float"), (None, "None"), ((1, 2), "a tuple")])
def test_a_python_value_names_what_it_is_and_what_to_return(value, kind):
    with pytest.raises(TypeError, match=rf"returned {kind}, not a tensor: return a scalar tensor .*F.mse_loss"):
        checked_loss(value, WHO)


def test_a_detached_loss_is_refused_while_gradients_are_taken():
    with pytest.raises(TypeError, match="no gradient flows through"):
        checked_loss(torch.tensor(1.0), WHO)
    with torch.no_grad():
        assert checked_loss(torch.tensor(1.0), WHO).dim() == 0  # an evaluation needs none


def test_a_scalar_passes_as_a_0_d_tensor_gradients_still_flow_through():
    weight = torch.ones(3, requires_grad=True)
    loss = checked_loss((weight * 2).sum().reshape(1), WHO)
    assert loss.shape == ()
    loss.backward()
    assert weight.grad.tolist() == [2.0, 2.0, 2.0]
