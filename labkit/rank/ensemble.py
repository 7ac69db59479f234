"""One ensemble member, trained alone on one rank: no communication at all.

``train_member(spec)`` is the task ``lab.ensemble`` hands to the work-stealing
queue (``runs.tasks``). The member builds its own zoo model from its own seed,
trains it on the full data (every step's whole global batch, the same batches
for every member: the diversity comes from the seed or the learning rate), and
then predicts held-out batches, ones no member trained on (batch numbers from
``HELDOUT_FROM`` on, drawn from the same distribution).

Everything comes back as numpy arrays, so the notebook combines predictions
without importing torch, and the trained weights come back too: a member lost
with its rank after it finished is not lost to the notebook.
"""

from __future__ import annotations

import torch

from labkit.spec.train_config import TrainConfig
from labkit.torch_support.optimizers import make_optimizer
from labkit.zoo.catalog import model

HELDOUT_FROM = 1_000_000  # batch numbers from here on are never trained on


def _predict(network: torch.nn.Module, inputs: torch.Tensor, classifies: bool) -> torch.Tensor:
    """Class probabilities (a classifier's, such as the GPT's next token) or the regression output (the MLP)."""
    output = network(inputs)
    if classifies:
        return torch.softmax(output.float(), dim=-1)
    return output.float()


def train_member(spec: dict) -> dict:
    """Train member ``spec["member"]`` and predict the held-out batches; see the module docstring."""
    config = TrainConfig(model=spec["model"], lr=spec["lr"], optimizer=spec["optimizer"],
                         model_settings=spec["model_settings"])
    model_config = config.model_config
    declared = model(spec["model"])
    network = declared.build(model_config, spec["seed"], "cpu")
    optimizer = make_optimizer(network.parameters(), config)
    data = declared.data(model_config, spec["data_seed"])
    loss_fn = declared.loss
    losses = []
    for step in range(spec["steps"]):
        inputs, targets = data.batch(step, spec["global_batch"])
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(network(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    predictions, answers = [], []
    with torch.no_grad():
        network.eval()
        for batch in range(spec["heldout_batches"]):
            inputs, targets = data.batch(HELDOUT_FROM + batch, spec["global_batch"])
            predictions.append(_predict(network, inputs, declared.classifies))
            answers.append(targets)
    from labkit.wire.current import this_rank

    return {
        "member": spec["member"],
        "seed": spec["seed"],
        "lr": spec["lr"],
        "rank": this_rank().rank,
        "losses": losses,
        "predictions": torch.cat(predictions).numpy(),
        "targets": torch.cat(answers).numpy(),
        "weights": {name: tensor.detach().numpy().copy() for name, tensor in network.state_dict().items()},
    }
