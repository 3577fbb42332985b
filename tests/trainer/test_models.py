"""Built-in and user models build from the spec with seeded weights; optimizers and evaluation."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from kubetrain.api.spec import Model, Optimizer
from kubetrain.trainer.errors import ConfigError, LoadError
from kubetrain.trainer.models import build_model, build_optimizer, evaluate
from kubetrain.trainer.objectives import build_objective


@pytest.mark.parametrize(
    "spec, input_shape",
    [
        (Model(name="mlp"), (64,)),
        (Model(name="mlp", args={"hidden": 16, "layers": 3}), (2, 5)),
        (Model(name="cnn"), (64,)),
        (Model(name="cnn", args={"channels": 4, "hidden": 8}), (1, 6, 6)),
        (Model(name="cnn", args={"channels": 4}), (5, 7)),
    ],
    ids=["mlp digits", "mlp deep on 2-D samples", "cnn digits as 1x8x8", "cnn on images", "cnn on 2-D samples"],
)
def test_builtin_models_map_samples_to_class_scores(spec: Model, input_shape: tuple[int, ...]) -> None:
    model = build_model(spec, input_shape, num_classes=3, seed=0)
    assert model(torch.zeros(2, *input_shape)).shape == (2, 3)


def test_same_seed_same_weights() -> None:
    a, b, c = (build_model(Model(name="mlp"), (8,), 2, seed) for seed in (4, 4, 5))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


@pytest.mark.parametrize(
    "spec, message",
    [
        (Model(name="mlp", args={"hidden": 0}), "mlp needs hidden >= 1 and layers >= 0, got hidden=0, layers=1"),
        (Model(name="mlp", args={"layers": -1}), "mlp needs hidden >= 1 and layers >= 0, got hidden=128, layers=-1"),
        (Model(name="cnn", args={"channels": 0}), "cnn needs channels >= 1 and hidden >= 1, got channels=0, hidden=64"),
        (Model(name="cnn", args={"hidden": 0}), "cnn needs channels >= 1 and hidden >= 1, got channels=16, hidden=0"),
    ],
    ids=["mlp hidden 0", "mlp layers -1", "cnn channels 0", "cnn hidden 0"],
)
def test_builtin_model_sizes_below_their_least_name_the_args(spec: Model, message: str) -> None:
    with pytest.raises(ConfigError, match="^spec.model.args: " + message + "$"):
        build_model(spec, (64,), 4, seed=0)


def test_cnn_on_flat_non_square_features_suggests_mlp() -> None:
    with pytest.raises(ConfigError, match=r"got shape \(32,\); use mlp for flat features"):
        build_model(Model(name="cnn"), (32,), 4, seed=0)


def test_user_entrypoint_gets_args_input_shape_and_num_classes(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "usermodel.py").write_text(
        "import math, torch\n"
        "def make(input_shape, num_classes, scale=1):\n"
        "    width = math.prod(input_shape) * scale\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(width, num_classes))\n"
        "def not_a_module(input_shape, num_classes):\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(Model(entrypoint="usermodel:make", args={"scale": 1}), (3, 2), 5, seed=0)
    assert model(torch.zeros(1, 3, 2)).shape == (1, 5)
    with pytest.raises(LoadError, match="usermodel:not_a_module returned int; expected a torch.nn.Module"):
        build_model(Model(entrypoint="usermodel:not_a_module"), (3,), 2, seed=0)
    sys.modules.pop("usermodel", None)


def test_user_entrypoint_for_regression_gets_output_shape_instead_of_num_classes(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "userregressor.py").write_text(
        "import math, torch\n"
        "def make(input_shape, output_shape):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 6),\n"
        "                               torch.nn.Unflatten(1, output_shape))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(Model(entrypoint="userregressor:make"), (4,), None, seed=0, output_shape=(2, 3))
    assert model(torch.zeros(5, 4)).shape == (5, 2, 3)
    sys.modules.pop("userregressor", None)


@pytest.mark.parametrize(
    "spec, kind",
    [
        (Optimizer(name="sgd", momentum=0.5, weight_decay=0.1), torch.optim.SGD),
        (Optimizer(name="adam"), torch.optim.Adam),
    ],
    ids=["sgd", "adam"],
)
def test_optimizer_follows_the_spec(spec: Optimizer, kind: type) -> None:
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), spec)
    assert isinstance(opt, kind)
    assert opt.defaults["lr"] == spec.learning_rate and opt.defaults["weight_decay"] == spec.weight_decay


def test_evaluate_reports_loss_and_accuracy_and_nan_when_empty() -> None:
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]])
    loss, accuracy = evaluate(model, x, torch.tensor([0, 1, 1]), batch_size=2)
    assert accuracy == pytest.approx(2 / 3) and loss > 0 and model.training
    assert all(math.isnan(v) for v in evaluate(model, x[:0], torch.tensor([], dtype=torch.long)))


def test_evaluate_with_a_regression_loss_reports_its_mean_and_no_accuracy() -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x, y = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[1.0], [4.0], [3.0]])
    loss, accuracy = evaluate(model, x, y, batch_size=2, objective=build_objective("mse"))
    assert loss == pytest.approx(4 / 3) and math.isnan(accuracy)  # batches of 2 and 1, weighted by samples
