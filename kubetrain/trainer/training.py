"""The pieces of a training loop every mode shares: the step, its gradients, the step budget."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubetrain.api.spec import Training

from .checkpoint import capture_rng_state, restore_rng_state
from .data import ShardCursor
from .models import load_model_state, model_state
from .objectives import CROSS_ENTROPY, NEXT_TOKEN, Objective
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


@dataclass(frozen=True)
class StepRecipe:
    """How one optimizer step runs (spec.training): micro-batches, precision, clipping, and the learning rate
    at each step, a function of the step alone (no scheduler state: a resumed run continues it exactly)."""

    learning_rate: float
    micro_batches: int = 1
    bf16: bool = False
    max_grad_norm: float | None = None
    warmup_steps: int = 0
    cosine: bool = False

    @classmethod
    def of(cls, training: Training) -> "StepRecipe":
        optimizer = training.optimizer
        return cls(learning_rate=optimizer.learning_rate, micro_batches=training.gradient_accumulation_steps,
                   bf16=training.precision == "bf16", max_grad_norm=training.max_grad_norm,
                   warmup_steps=optimizer.warmup_steps, cosine=optimizer.schedule == "cosine")

    def rate(self, step: int, total_steps: int) -> float:
        """The learning rate of step `step` (0-based: the step about to run) of a run of `total_steps`."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if not self.cosine:
            return self.learning_rate
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


PLAIN = StepRecipe(learning_rate=0.0)
"""One batch, one forward and backward, float32, no clipping; the optimizer's own learning rate."""


def compute_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, objective: Objective | None = None,
    recipe: StepRecipe = PLAIN, scale: float = 1.0,
) -> float:
    """Forward and backward on one batch with `objective`'s loss (crossEntropy by default), in
    `recipe.micro_batches` parts (their gradients summed, each part's loss weighted by its share of the batch),
    under bfloat16 autocast with `recipe.bf16`; the gradients of `scale` times the loss (a fault-tolerant rank's
    share of its step's batch: its weight in the average, before a sharded model's reduce-scatter).

    Leaves the gradients in `.grad`; returns the loss (unscaled).
    """
    objective = objective or CROSS_ENTROPY
    model.zero_grad(set_to_none=True)
    if recipe.micro_batches == 1 and not recipe.bf16:  # the plain step, exactly as it always was
        loss = objective.loss(model(x), y)
        (loss * scale if scale != 1.0 else loss).backward()
        return float(loss.item())
    total = 0.0
    for xs, ys in zip(x.tensor_split(recipe.micro_batches), y.tensor_split(recipe.micro_batches)):
        with torch.autocast(xs.device.type, dtype=torch.bfloat16, enabled=recipe.bf16):
            loss = objective.loss(model(xs), ys) * (len(xs) / len(x))
        (loss * scale if scale != 1.0 else loss).backward()
        total += float(loss.item())
    return total


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    objective: Objective | None = None,
    recipe: StepRecipe = PLAIN,
    step: int = 0,
    total_steps: int = 0,
) -> float:
    """One local optimizer step on one batch (step `step` of `total_steps`, for the learning rate of `recipe`);
    returns the batch's loss before the update."""
    if recipe is not PLAIN:
        rate = recipe.rate(step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = rate
    loss = compute_gradients(model, x, y, objective, recipe)
    if recipe.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], recipe.max_grad_norm)
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
    samples: int  # the counters, set by start_state and load_state
    loss: float

    @property
    def counters(self) -> tuple[str, ...]:
        """COUNTERS, and a causal-lm's evaluation of the pretrained model before any step (`baseline_eval_loss`,
        what the fine-tuning is measured against)."""
        data = getattr(self, "data", None)
        fine_tuning = data is not None and data.objective is NEXT_TOKEN
        return (*self.COUNTERS, "baseline_eval_loss") if fine_tuning else self.COUNTERS

    def start_state(self) -> None:
        """A run from its start: step 0, nothing counted, evaluated or checkpointed yet."""
        self.step = 0
        self.baseline_eval_loss = float("nan")
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
        return model_state(self.model), self.optimizer.state_dict(), self.cursor.state_dict()

    def state(self) -> dict[str, Any]:
        model, optimizer, cursor = self.weights_state()
        return {
            "step": self.step,
            "model": model,
            "optimizer": optimizer,
            "cursor": cursor,
            "rng": capture_rng_state(),
            **{name: getattr(self, name) for name in self.counters},
        }

    def load_state(self, step: int, state: dict[str, Any], weights: bool = True) -> None:
        """Continue from a checkpoint's `state` of `step`; `weights=False`: the model and optimizer are loaded
        already (FSDP loads them its own way)."""
        self.step = step
        if weights:
            load_model_state(self.model, state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_cursor(state["cursor"])
        restore_rng_state(state["rng"])
        for name in self.counters:
            setattr(self, name, state[name])
        self.checkpoint_step = step

    def load_cursor(self, saved: dict[str, Any]) -> None:
        self.cursor.load_state_dict(saved)

    def record_eval(self, eval_loss: float, eval_accuracy: float) -> None:
        """This step's evaluation: kept for the results, set in the gauges, written as an `eval` event, logged."""
        self.eval_loss, self.eval_accuracy = eval_loss, eval_accuracy
        self.metrics.eval_loss.set(eval_loss)
        self.metrics.eval_accuracy.set(eval_accuracy)
        if "baseline_eval_loss" not in self.counters:
            self.events.write("eval", step=self.step, epoch=self.cursor.epoch, eval_loss=eval_loss,
                              eval_accuracy=eval_accuracy)
            log.info("%s: step %d: eval accuracy %.4f, loss %.4f", self.ctx.replica, self.step, eval_accuracy,
                     eval_loss)
            return
        perplexity = perplexity_of(eval_loss)
        if self.step == 0:
            self.baseline_eval_loss = eval_loss
        self.metrics.eval_perplexity.set(perplexity)
        self.events.write("eval", step=self.step, epoch=self.cursor.epoch, eval_loss=eval_loss,
                          eval_perplexity=perplexity)
        log.info("%s: step %d: eval loss %.4f, perplexity %.3f%s", self.ctx.replica, self.step, eval_loss,
                 perplexity, " (the pretrained model)" if self.step == 0 else "")

    def eval_results(self) -> dict[str, Any]:
        """The evaluation figures of a results file: accuracy and loss; a causal-lm's perplexity and the
        pretrained model's loss."""
        figures = {"eval_accuracy": self.eval_accuracy, "eval_loss": self.eval_loss}
        if "baseline_eval_loss" in self.counters:
            figures.update(eval_perplexity=perplexity_of(self.eval_loss), baseline_eval_loss=self.baseline_eval_loss)
        return figures

    def evaluates_baseline(self) -> bool:
        """A causal-lm at step 0 evaluates the pretrained model first: what fine-tuning must improve on."""
        return self.step == 0 and "baseline_eval_loss" in self.counters


def perplexity_of(loss: float) -> float:
    """exp(loss), NaN for an unmeasured loss and infinite past float range."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf
