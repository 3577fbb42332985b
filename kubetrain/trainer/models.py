"""Models and optimizers from the spec: the built-in registry, user entry points, and evaluation."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubetrain.api.spec import Model, Optimizer, Spec

from .errors import ConfigError, LoadError

if TYPE_CHECKING:
    from .data import Data
from .objectives import CROSS_ENTROPY, Objective
from .plugins import call_with_args, load_entrypoint


def _head(width: int, num_classes: int | None, output_shape: tuple[int, ...] | None) -> list[nn.Module]:
    """The last layer: one score per class, or one value per target element, shaped as the target."""
    if output_shape is None:
        assert num_classes is not None
        return [nn.Linear(width, num_classes)]
    out: list[nn.Module] = [nn.Linear(width, math.prod(output_shape))]
    if len(output_shape) > 1:
        out.append(nn.Unflatten(1, output_shape))
    return out


def _check_sizes(model: str, **sizes: tuple[int, int]) -> None:
    """A built-in model's sizes (`name=(value, least)`, from spec.model.args): ConfigError naming them all when one
    is below its least."""
    if all(value >= least for value, least in sizes.values()):
        return
    needs = " and ".join(f"{name} >= {least}" for name, (_, least) in sizes.items())
    got = ", ".join(f"{name}={value}" for name, (value, _) in sizes.items())
    raise ConfigError(f"spec.model.args: {model} needs {needs}, got {got}")


def mlp(input_shape: tuple[int, ...], num_classes: int | None = None, hidden: int = 128, layers: int = 1,
        output_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Flatten, then `layers` ReLU layers of width `hidden`, then the class scores (or the regression output)."""
    _check_sizes("mlp", hidden=(hidden, 1), layers=(layers, 0))
    width = math.prod(input_shape)
    modules: list[nn.Module] = [nn.Flatten()]
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    modules += _head(width, num_classes, output_shape)
    return nn.Sequential(*modules)


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of the input: images as they are, flat square vectors (digits' 64) as 1 x s x s."""
    if len(input_shape) == 3:
        return input_shape  # type: ignore[return-value]
    if len(input_shape) == 2:
        return (1, *input_shape)
    side = math.isqrt(input_shape[0]) if len(input_shape) == 1 else 0
    if side * side != math.prod(input_shape) or side == 0:
        raise ConfigError(
            f"spec.model.name: cnn needs image-shaped samples ((C, H, W), (H, W) or a flat square "
            f"length such as digits' 64), got shape {input_shape}; use mlp for flat features"
        )
    return (1, side, side)


def cnn(input_shape: tuple[int, ...], num_classes: int | None = None, channels: int = 16, hidden: int = 64,
        output_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Two 3x3 convolutions (same padding), a ReLU layer of width `hidden`, then the class scores (or the output)."""
    _check_sizes("cnn", channels=(channels, 1), hidden=(hidden, 1))
    c, h, w = _image_shape(input_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Unflatten(1, (c, h, w)),
        nn.Conv2d(c, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * h * w, hidden),
        nn.ReLU(),
        *_head(hidden, num_classes, output_shape),
    )


BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn}


def _takes(fn: Callable[..., object], name: str, instead_of: str) -> bool:
    """Whether `fn` declares a parameter `name` but none `instead_of` (and no **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    return name in params and instead_of not in params


def build_model(
    spec: Model,
    input_shape: tuple[int, ...],
    num_classes: int | None,
    seed: int,
    output_shape: tuple[int, ...] | None = None,
) -> nn.Module:
    """The model of `spec`, its weights drawn after torch.manual_seed(seed): equal on every replica.

    Exactly one of `num_classes` (classification: the model outputs (N,
    num_classes)) and `output_shape` (regression: it outputs (N,
    *output_shape)) is given, as Data's num_classes and target_shape are.
    A factory receives whichever is given, so classification factories
    written before regression existed keep working.
    """
    if (num_classes is None) == (output_shape is None):
        raise ValueError(f"build_model: give num_classes or output_shape, got {num_classes} and {output_shape}")
    torch.manual_seed(seed)
    if spec.entrypoint is not None:
        fn = load_entrypoint(spec.entrypoint, "spec.model.entrypoint")
        what, path = spec.entrypoint, "spec.model.entrypoint"
    elif spec.name in BUILTIN_MODELS:
        fn, what, path = BUILTIN_MODELS[spec.name], spec.name, "spec.model.args"
    else:
        raise LoadError(f"spec.model.name: unknown model {spec.name!r}; expected one of {', '.join(BUILTIN_MODELS)}")
    # Flat-sample models see (N, features); the built-ins reshape what they need themselves.
    head = {"num_classes": num_classes} if output_shape is None else {"output_shape": tuple(output_shape)}
    args = {**spec.args, "input_shape": tuple(input_shape), **head}
    if output_shape is not None and spec.entrypoint is not None and _takes(fn, "num_classes", "output_shape"):
        raise ConfigError(
            f"spec.model.entrypoint: {what} takes num_classes, but with spec.training.loss other than "
            "crossEntropy the targets are real values: a model factory then gets output_shape (the shape of "
            "one sample's target) instead"
        )
    model = call_with_args(fn, args, what, path)
    if not isinstance(model, nn.Module):
        raise LoadError(f"spec.model.entrypoint: {what} returned {type(model).__name__}; expected a torch.nn.Module")
    return model


def build_optimizer(params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], spec: Optimizer) -> torch.optim.Optimizer:
    """sgd (momentum, weight decay), adam (weight decay) or adamw (decoupled weight decay) with the spec's
    learning rate; `params` may be torch's parameter groups, whose own settings override the spec's. Frozen
    parameters (requires_grad False: a LoRA job's base model) are left out: they have no state to keep."""
    trainable: list[Any] = [p for p in params if not isinstance(p, torch.Tensor) or p.requires_grad]
    params = trainable
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.learning_rate, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)
    raise ConfigError(f"spec.training.optimizer.name: expected sgd or adam, got {spec.name!r}")


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024, objective: Objective | None = None
) -> tuple[float, float]:
    """Mean loss of `objective` (crossEntropy by default) and accuracy of `model` on (x, y).

    The accuracy is NaN, "not measured", where the objective has none (every
    loss but crossEntropy); both are NaN for an empty set.
    """
    objective = objective or CROSS_ENTROPY
    if len(x) == 0:
        return math.nan, math.nan
    batch_size = min(batch_size, objective.eval_batch_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, counted, correct = 0.0, 0, 0
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        output = model(xb)
        total, count = objective.eval_sums(output, yb)
        loss_sum, counted = loss_sum + total, counted + count
        if objective.measures_accuracy:
            correct += int((output.argmax(dim=1) == yb).sum())
    model.train(was_training)
    loss = loss_sum / counted if counted else math.nan
    return loss, correct / len(x) if objective.measures_accuracy else math.nan


def model_and_data(spec: Spec, data: "Data | None" = None, meta: bool = False) -> tuple[nn.Module, "Data"]:
    """The job's model and data, its targets prepared for spec.training.loss (Data.objective).

    Every replica and tool that rebuilds the job's model (the loops, the
    shards, verify, export) calls this one function, so they all build the
    same model with the same initial weights (seeded after the data is read).
    `data`: the job's data, already loaded (a tool that builds several models). `meta`: a causal-lm stays on
    the meta device, to be sharded, then materialized (kubetrain/trainer/causal_lm.py); the other models are small and
    built whole whatever `meta` says.
    """
    from .data import load_data

    assert spec.dataset is not None and spec.training is not None and spec.model is not None
    if spec.model.name == "causal-lm":
        from . import causal_lm

        return causal_lm.model_and_data(spec, meta=meta)
    if data is None:
        data = load_data(spec.dataset, spec.training.seed, spec.training.loss)
    model = build_model(spec.model, data.input_shape, data.num_classes, spec.training.seed,
                        output_shape=data.target_shape)
    return model, data


def model_state(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of `model`: its state_dict, or what it says it trains (a LoRA job's adapters)."""
    trainable = getattr(model, "trainable_state", None)
    state = trainable() if trainable is not None else None
    return state if state is not None else model.state_dict()


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a checkpoint's `model_state` back: all of it, or a LoRA job's adapters over the pretrained base."""
    trainable = getattr(model, "trainable_state", None)
    if trainable is None or trainable() is None:
        model.load_state_dict(state)
        return
    missing = set(trainable()) - set(state)
    result = model.load_state_dict(state, strict=False)
    if missing or result.unexpected_keys:
        raise LoadError(f"the checkpoint's adapters do not fit the model: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(result.unexpected_keys)[:3]}")
