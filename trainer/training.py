"""The pieces of a training loop every mode shares: the step, its gradients, the step budget."""

from __future__ import annotations

import torch
from torch import nn

from kubetrain_operator.api.spec import Training

from .objectives import CROSS_ENTROPY, Objective
from .preload import optimizer_step

# Aim for about this many `train` events per run, whatever its length.
TRAIN_EVENTS_PER_RUN = 200


def planned_steps(training: Training, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: maxSteps, or epochs (10 when neither is set) x steps_per_epoch."""
    if training.max_steps is not None:
        return training.max_steps
    epochs = training.effective_epochs
    assert epochs is not None  # set whenever maxSteps is not
    return epochs * steps_per_epoch


def log_interval(total_steps: int) -> int:
    """Steps between `train` events: every step for short runs, about 200 events for long ones."""
    return max(1, total_steps // TRAIN_EVENTS_PER_RUN)


def compute_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, objective: Objective | None = None
) -> float:
    """Forward and backward on one batch with `objective`'s loss (crossEntropy by default).

    Leaves the gradients in `.grad`; returns the loss.
    """
    model.zero_grad(set_to_none=True)
    loss = (objective or CROSS_ENTROPY).loss(model(x), y)
    loss.backward()
    return float(loss.item())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    objective: Objective | None = None,
) -> float:
    """One local optimizer step on one batch; returns the batch's loss before the update."""
    loss = compute_gradients(model, x, y, objective)
    optimizer_step(optimizer)  # a restarted replica's first steps: not waiting for torch._dynamo (preload.py)
    return loss
