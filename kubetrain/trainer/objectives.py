"""The objective of `spec.training.loss`: the loss, the targets it takes, and whether accuracy applies.

A registry of built-in losses by name, and user losses by entry point. Two
kinds of targets:

- classification (crossEntropy): y is 1-D, one non-negative integer class
  label per sample; the model outputs one score per class, (N, num_classes);
  accuracy is measured.
- regression (mse, l1, smoothL1, bceWithLogits, and every entry point): y is
  float32 of any shape with one target per sample along axis 0; a 1-D y of
  shape (N,) is taken as (N, 1). The model outputs exactly the targets' shape,
  (N, *target_shape); accuracy is not measured (NaN, written as null).

A loss entry point 'package.module:function' is a factory called without
arguments that returns `loss(output, target) -> scalar tensor` (the mean over
the batch); a torch.nn loss class such as `torch.nn:HuberLoss` fits as it is.
An entry point always gets regression targets: integer class labels reach it
as float32 of shape (N, 1), and a built-in model then has one output, not one
per class. Class labels train with crossEntropy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch
from torch.nn import functional as F

from .errors import ConfigError, LoadError
from .plugins import call_with_args, load_entrypoint

FIELD = "spec.training.loss"
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Objective:
    """One entry of the registry: how the targets are prepared, the loss, whether accuracy applies."""

    name: str = ""
    measures_accuracy = False
    """True only for class labels against class scores: the argmax can be right or wrong."""

    @property
    def classification(self) -> bool:
        return self.measures_accuracy

    def targets(self, y: np.ndarray, where: str) -> torch.Tensor:
        """The dataset's y as this loss takes it; LoadError names `where` (the dataset) and the loss."""
        if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
            raise LoadError(f"{where}: y must be numeric for {FIELD} {self.name}, got dtype {y.dtype}")
        values = y.astype(np.float32)
        if not np.isfinite(values).all():
            raise LoadError(f"{where}: y holds NaN or infinite values (or values too large for float32)")
        return torch.as_tensor(values.reshape(len(values), -1) if values.ndim == 1 else values)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of the batch, a scalar tensor to call backward() on."""
        raise NotImplementedError

    eval_batch_size = 1024
    """Samples per forward pass when evaluating."""

    def batch_sum(self, output: torch.Tensor, target: torch.Tensor) -> float:
        """The loss summed over the batch's samples (for a mean over a whole eval split)."""
        return float(self.loss(output, target)) * len(target)

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
        """(loss summed, what it is summed over) for a batch: the eval loss is their totals' ratio."""
        return self.batch_sum(output, target), len(target)


class CrossEntropy(Objective):
    """Class scores against integer class labels: the default, and the only objective with accuracy."""

    name = "crossEntropy"
    measures_accuracy = True

    def targets(self, y: np.ndarray, where: str) -> torch.Tensor:
        if not np.issubdtype(y.dtype, np.integer):
            raise LoadError(
                f"{where}: y holds {y.dtype} values, but {FIELD} crossEntropy needs integer class labels; "
                "for real-valued targets set spec.training.loss to mse, l1, smoothL1, bceWithLogits "
                "or an entry point"
            )
        if y.ndim != 1:
            raise LoadError(
                f"{where}: y must be 1-D with one class label per sample for {FIELD} crossEntropy, got shape "
                f"{y.shape}; for targets of another shape use a regression loss (mse, l1, smoothL1, "
                "bceWithLogits or an entry point)"
            )
        if y.min() < 0:
            raise LoadError(f"{where}: y must hold non-negative integer labels, got {int(y.min())}")
        return torch.as_tensor(y.astype(np.int64))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def batch_sum(self, output: torch.Tensor, target: torch.Tensor) -> float:
        return float(F.cross_entropy(output, target, reduction="sum"))


IGNORE_INDEX = -100
"""A causal-lm target that is no token (padding): F.cross_entropy's default ignore_index."""
PAD = -1
"""A causal-lm sample's position that holds no token (after its record's end)."""


class NextToken(Objective):
    """A causal language model's loss: logits (N, L, V) at each position against the next token of the sample,
    targets (N, L) of token ids with IGNORE_INDEX where there is none (padding). Averaged over the tokens; the
    eval loss is the mean over every evaluated token (its exp the perplexity)."""

    name = "nextToken"
    eval_batch_size = 8

    def targets(self, y: np.ndarray, where: str) -> torch.Tensor:
        return torch.as_tensor(y.astype(np.int64))

    @staticmethod
    def _shifted(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = output.shape[-1]
        return output[:, :-1].reshape(-1, vocab).float(), target[:, 1:].reshape(-1)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(*self._shifted(output, target), ignore_index=IGNORE_INDEX)

    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
        logits, labels = self._shifted(output, target)
        total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return float(total), int((labels != IGNORE_INDEX).sum())


NEXT_TOKEN: Objective = NextToken()


class Elementwise(Objective):
    """A built-in regression loss comparing output and target element by element, averaged."""

    def __init__(self, name: str, fn: LossFn):
        self.name = name
        self.fn = fn

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch would broadcast (N, 1) against (N,) into (N, N) with only a
        # warning, and train on a meaningless loss: refuse instead.
        if output.shape != target.shape:
            raise ConfigError(
                f"{FIELD}: {self.name} needs the model's output in the targets' shape: got output "
                f"{tuple(output.shape)}, targets {tuple(target.shape)}; a model entry point is given "
                "output_shape, the shape of one sample's target"
            )
        return self.fn(output, target)


class BCEWithLogits(Elementwise):
    """Logits against probabilities (or 0/1 labels) in [0, 1], of any shape."""

    def __init__(self) -> None:
        super().__init__("bceWithLogits", F.binary_cross_entropy_with_logits)

    def targets(self, y: np.ndarray, where: str) -> torch.Tensor:
        values = super().targets(y, where)
        if len(values) and (float(values.min()) < 0 or float(values.max()) > 1):
            raise LoadError(
                f"{where}: {FIELD} bceWithLogits needs targets in [0, 1], got values from "
                f"{float(values.min())} to {float(values.max())}"
            )
        return values


class EntryPoint(Objective):
    """A user loss: the factory at 'package.module:function' returns loss(output, target)."""

    def __init__(self, ref: str):
        self.name = ref
        factory = load_entrypoint(ref, FIELD)
        try:
            required = [
                p for p in inspect.signature(factory).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            required = []
        if len(required) == 2:
            # The commonest slip: pointing at the loss itself instead of a factory of it.
            raise ConfigError(
                f"{FIELD}: {ref} takes ({', '.join(p.name for p in required)}): it looks like the loss "
                "itself; the entry point must return the loss, e.g. `def make(): return my_loss`"
            )
        fn = call_with_args(factory, {}, ref, FIELD)
        if not callable(fn):
            raise LoadError(f"{FIELD}: {ref} returned {type(fn).__name__}; expected a callable loss(output, target)")
        self.fn = fn

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = self.fn(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise LoadError(f"{FIELD}: the loss of {self.name} returned {what}; expected a scalar tensor")
        return value.reshape(())


BUILTIN_OBJECTIVES: dict[str, Callable[[], Objective]] = {
    "crossEntropy": CrossEntropy,
    "mse": lambda: Elementwise("mse", F.mse_loss),
    "l1": lambda: Elementwise("l1", F.l1_loss),
    "smoothL1": lambda: Elementwise("smoothL1", F.smooth_l1_loss),
    "bceWithLogits": BCEWithLogits,
}

CROSS_ENTROPY: Objective = CrossEntropy()
"""The default objective, for callers that do not name one."""


def build_objective(loss: str = "crossEntropy") -> Objective:
    """The objective of `spec.training.loss`: a built-in name, or an entry point (imported now)."""
    if loss in BUILTIN_OBJECTIVES:
        return BUILTIN_OBJECTIVES[loss]()
    if ":" in loss:
        return EntryPoint(loss)
    raise ConfigError(
        f"{FIELD}: unknown loss {loss!r}; expected one of {', '.join(BUILTIN_OBJECTIVES)} or 'package.module:function'"
    )
