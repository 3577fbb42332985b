"""Models and optimizers from the spec: the built-in registry, user entry points, and evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from kubetrain_operator.api.spec import Model, Optimizer

from .data import call_with_args, load_entrypoint
from .errors import ConfigError, LoadError


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128, layers: int = 1) -> nn.Module:
    """Flatten, then `layers` ReLU layers of width `hidden`, then the class scores."""
    if hidden < 1 or layers < 0:
        raise ConfigError(
            f"spec.model.args: mlp needs hidden >= 1 and layers >= 0, got hidden={hidden}, layers={layers}"
        )
    width = math.prod(input_shape)
    modules: list[nn.Module] = [nn.Flatten()]
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, num_classes))
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


def cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 16, hidden: int = 64) -> nn.Module:
    """Two 3x3 convolutions (same padding), then a ReLU layer of width `hidden`, then the class scores."""
    if channels < 1 or hidden < 1:
        raise ConfigError(f"spec.model.args: cnn needs channels >= 1 and hidden >= 1, got {channels}, {hidden}")
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
        nn.Linear(hidden, num_classes),
    )


BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn}


def build_model(spec: Model, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """The model of `spec`, its weights drawn after torch.manual_seed(seed): equal on every replica."""
    torch.manual_seed(seed)
    if spec.entrypoint is not None:
        fn = load_entrypoint(spec.entrypoint, "spec.model.entrypoint")
        what, path = spec.entrypoint, "spec.model.entrypoint"
    elif spec.name in BUILTIN_MODELS:
        fn, what, path = BUILTIN_MODELS[spec.name], spec.name, "spec.model.args"
    else:
        raise LoadError(f"spec.model.name: unknown model {spec.name!r}; expected one of {', '.join(BUILTIN_MODELS)}")
    # Flat-sample models see (N, features); the built-ins reshape what they need themselves.
    args = {**spec.args, "input_shape": tuple(input_shape), "num_classes": num_classes}
    model = call_with_args(fn, args, what, path)
    if not isinstance(model, nn.Module):
        raise LoadError(f"spec.model.entrypoint: {what} returned {type(model).__name__}; expected a torch.nn.Module")
    return model


def build_optimizer(params: Iterable[torch.nn.Parameter], spec: Optimizer) -> torch.optim.Optimizer:
    """sgd (momentum, weight decay) or adam (weight decay) with the spec's learning rate."""
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.learning_rate, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)
    raise ConfigError(f"spec.training.optimizer.name: expected sgd or adam, got {spec.name!r}")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` on (x, y); (nan, nan) for an empty set."""
    if len(x) == 0:
        return math.nan, math.nan
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        logits = model(xb)
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return loss_sum / len(x), correct / len(x)
