"""The pieces of a training loop every mode shares: the step, its gradients, the step budget."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubetrain_operator.api.spec import Training

from .checkpoint import capture_rng_state, restore_rng_state
from .data import ShardCursor
from .objectives import CROSS_ENTROPY, Objective
from .preload import optimizer_step

if TYPE_CHECKING:
    from .context import ReplicaContext
    from .events import EventLog
    from .metrics import TrainerMetrics

log = logging.getLogger(__name__)

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


class TrainState:
    """What a built-in loop (Single, DDP) trains and checkpoints, with the one `state` and `load_state` both use.

    A checkpoint holds the step, the model, its optimizer, the data cursor,
    the RNG and the loop's counters (`COUNTERS`: samples and loss, and what a
    loop adds, e.g. DDP's bytes). A loop builds its model, optimizer and
    cursor, then calls `start_state`; it may override `weights_state` and
    `load_cursor` (DDP: FSDP's sharded weights, a cursor dealt again after a
    resize).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    cursor: ShardCursor
    ctx: ReplicaContext
    metrics: TrainerMetrics
    events: EventLog
    COUNTERS: tuple[str, ...] = ("samples", "loss")
    """The loop's own figures a checkpoint carries beside the step, in the checkpoint's order."""

    def start_state(self) -> None:
        """A run from its start: step 0, nothing counted, evaluated or checkpointed yet."""
        self.step = 0
        for name in self.COUNTERS:
            setattr(self, name, 0)
        self.loss = float("nan")
        self.eval_loss = float("nan")
        self.eval_accuracy = float("nan")
        self.eval_step = -1
        """The step last evaluated (-1: none)."""
        self.checkpoint_step = -1
        """The step last checkpointed or resumed from (-1: none)."""

    def weights_state(self) -> tuple[Any, Any, Any]:
        """(model, optimizer, cursor) as a checkpoint holds them."""
        return self.model.state_dict(), self.optimizer.state_dict(), self.cursor.state_dict()

    def state(self) -> dict[str, Any]:
        model, optimizer, cursor = self.weights_state()
        return {
            "step": self.step,
            "model": model,
            "optimizer": optimizer,
            "cursor": cursor,
            "rng": capture_rng_state(),
            **{name: getattr(self, name) for name in self.COUNTERS},
        }

    def load_state(self, step: int, state: dict[str, Any], weights: bool = True) -> None:
        """Continue from a checkpoint's `state` of `step`; `weights=False`: the model and optimizer are loaded
        already (FSDP loads them its own way)."""
        self.step = step
        if weights:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_cursor(state["cursor"])
        restore_rng_state(state["rng"])
        for name in self.COUNTERS:
            setattr(self, name, state[name])
        self.checkpoint_step = step

    def load_cursor(self, saved: dict[str, Any]) -> None:
        self.cursor.load_state_dict(saved)

    def record_eval(self, eval_loss: float, eval_accuracy: float) -> None:
        """This step's evaluation: kept for the results, set in the gauges, written as an `eval` event, logged."""
        self.eval_loss, self.eval_accuracy = eval_loss, eval_accuracy
        self.metrics.eval_loss.set(eval_loss)
        self.metrics.eval_accuracy.set(eval_accuracy)
        self.events.write("eval", step=self.step, epoch=self.cursor.epoch, eval_loss=eval_loss,
                          eval_accuracy=eval_accuracy)
        log.info("%s: step %d: eval accuracy %.4f, loss %.4f", self.ctx.replica, self.step, eval_accuracy, eval_loss)
