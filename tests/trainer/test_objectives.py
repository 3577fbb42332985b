"""spec.training.loss: each loss trains on its targets, bad combinations name their fields, user code plugs in.

The example in examples/custom/regression (user model, dataset and loss, a
ParameterServer job) runs for real through `kubetrain run`, and `kubetrain
validate` finds (or misses) entry-point modules without running them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from helpers.jsonl import read_events
from support import EXAMPLES, job_doc, kubetrain
from kubetrain.api import load_one
from kubetrain.api.spec import BUILTIN_LOSSES, Dataset, Model, Optimizer
from kubetrain.trainer.data import load_data
from kubetrain.trainer.errors import EXIT_OK, ConfigError, LoadError
from kubetrain.trainer.models import build_model, build_optimizer, evaluate
from kubetrain.trainer.objectives import BUILTIN_OBJECTIVES, build_objective
from kubetrain.shared.launch import CODE_DIR_VAR
from kubetrain.trainer.single import run_single
from kubetrain.trainer.training import train_step

REGRESSION = EXAMPLES / "custom" / "regression"
USER_MODULES = ("curve_data", "curve_model", "curve_loss", "userloss", "usermodel")


@pytest.fixture
def code_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """code_dir(path): user entry points import from `path`, as KUBETRAIN_CODE_DIR makes them do.

    sys.path and the user modules are put back afterwards: the trainer changes
    them for good, which is right in its own process but not in pytest's.
    """

    def use(path: Path) -> None:
        monkeypatch.setenv(CODE_DIR_VAR, str(path))
        monkeypatch.syspath_prepend(str(path))  # makes monkeypatch restore sys.path whole

    yield use
    for name in USER_MODULES:
        sys.modules.pop(name, None)


def npz(tmp_path: Path, x: np.ndarray, y: np.ndarray) -> Dataset:
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=y)
    return Dataset(path=str(path), eval_fraction=0.25)


@dataclass
class LossCase:
    name: str
    loss: str
    y: np.ndarray  # targets of the 64 samples of X
    target_shape: tuple[int, ...] | None  # None: classification
    target_dtype: torch.dtype = torch.float32


RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 5)).astype(np.float32)
LOSS_CASES = [
    LossCase("crossEntropy on integer labels", "crossEntropy", (X[:, 0] > 0).astype(np.int64) + 2 * (X[:, 1] > 0),
             None, torch.int64),
    LossCase("mse on one value per sample", "mse", X @ np.arange(5, dtype=np.float32), (1,)),
    LossCase("l1 on a (2, 3) target per sample", "l1", np.repeat(X[:, :1, None], 6, 1).reshape(64, 2, 3), (2, 3)),
    LossCase("smoothL1 on integer counts, as floats", "smoothL1", np.abs(X[:, 0] * 3).astype(np.int64), (1,)),
    LossCase("bceWithLogits on multi-label 0/1 targets", "bceWithLogits", (X[:, :4] > 0).astype(np.int64), (4,)),
    LossCase("bceWithLogits on probabilities", "bceWithLogits", 1 / (1 + np.exp(-X[:, :2])), (2,)),
]


def test_every_loss_of_the_api_is_in_the_registry() -> None:
    assert tuple(BUILTIN_OBJECTIVES) == BUILTIN_LOSSES


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.name)
def test_each_builtin_loss_trains_on_its_targets(case: LossCase, tmp_path: Path) -> None:
    data = load_data(npz(tmp_path, X, case.y), seed=0, loss=case.loss)
    assert data.train_y.dtype == case.target_dtype
    assert data.target_shape == case.target_shape
    assert (data.num_classes is None) == (case.target_shape is not None)
    model = build_model(Model(name="mlp", args={"hidden": 32}), data.input_shape, data.num_classes, seed=0,
                        output_shape=data.target_shape)
    assert model(data.train_x[:3]).shape == (3, *(case.target_shape or (data.num_classes,)))
    optimizer = build_optimizer(model.parameters(), Optimizer(name="adam", learning_rate=0.01))
    before, _ = evaluate(model, data.train_x, data.train_y, objective=data.objective)
    for _ in range(60):
        train_step(model, optimizer, data.train_x, data.train_y, data.objective)
    after, accuracy = evaluate(model, data.train_x, data.train_y, objective=data.objective)
    # The least loss possible: 0 but for soft bceWithLogits targets (their entropy).
    floor = 0.0
    if case.loss == "bceWithLogits":
        floor = float(data.objective.loss(torch.logit(data.train_y, eps=1e-6), data.train_y))
    assert after - floor < 0.7 * (before - floor), (before, after, floor)
    if case.loss == "crossEntropy":
        assert accuracy > 0.9
    else:
        assert math.isnan(accuracy)  # "not measured": written as null


def test_crossentropy_default_keeps_the_old_loss_exactly() -> None:
    logits, labels = torch.randn(7, 3), torch.tensor([0, 2, 1, 1, 0, 2, 2])
    objective = build_objective()
    assert torch.equal(objective.loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels))
    model = torch.nn.Linear(3, 3)
    assert evaluate(model, logits, labels) == evaluate(model, logits, labels, objective=objective)


def test_a_user_loss_from_the_code_dir_trains_and_skips_accuracy(tmp_path: Path, code_dir) -> None:
    (tmp_path / "userloss.py").write_text(
        "import torch\n"
        "def mean_fourth_power():\n"
        "    return lambda output, target: ((output - target) ** 4).mean()\n"
        "class Huber(torch.nn.HuberLoss):\n"
        "    pass\n"
    )
    code_dir(tmp_path)
    y = X @ np.arange(5, dtype=np.float32) / 10
    for loss in ("userloss:mean_fourth_power", "userloss:Huber"):  # a factory, or a torch.nn loss class
        data = load_data(npz(tmp_path, X, y), seed=0, loss=loss)
        assert data.target_shape == (1,) and data.train_y.dtype == torch.float32
        model = build_model(Model(name="mlp"), data.input_shape, None, seed=0, output_shape=(1,))
        loss_value, accuracy = evaluate(model, data.eval_x, data.eval_y, objective=data.objective)
        assert loss_value > 0 and math.isnan(accuracy)


@dataclass
class BadCase:
    name: str
    loss: str
    y: np.ndarray
    error: type[Exception]
    words: list[str]
    user_code: str = ""
    step: bool = False  # the error comes at the first training step, not at loading
    model: Model = field(default_factory=lambda: Model(name="mlp"))


USER_CODE = (
    "import torch\n"
    "def the_loss_itself(output, target):\n"
    "    return ((output - target) ** 2).mean()\n"
    "def not_a_loss():\n"
    "    return 3\n"
    "def per_sample():\n"
    "    return lambda output, target: (output - target).abs().sum(dim=1)\n"
    "def classifier(input_shape, num_classes):\n"
    "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(5, num_classes))\n"
    "def wrong_width(input_shape, output_shape):\n"
    "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(5, 3))\n"
)
FLOATS = X[:, 0].copy()
BAD_CASES = [
    BadCase("crossEntropy on float targets", "crossEntropy", FLOATS, LoadError,
            ["spec.dataset.path: ", "spec.training.loss crossEntropy needs integer class labels", "mse"]),
    BadCase("crossEntropy on 2-D labels", "crossEntropy", np.zeros((64, 2), dtype=np.int64), LoadError,
            ["spec.dataset.path: ", "1-D with one class label per sample", "got shape (64, 2)"]),
    BadCase("bceWithLogits outside [0, 1]", "bceWithLogits", FLOATS, LoadError,
            ["spec.dataset.path: ", "bceWithLogits needs targets in [0, 1]"]),
    BadCase("mse on NaN targets", "mse", np.where(FLOATS > 0, np.nan, FLOATS), LoadError,
            ["spec.dataset.path: ", "NaN or infinite"]),
    BadCase("mse on strings", "mse", np.array(["a"] * 64), LoadError, ["y must be numeric for spec.training.loss mse"]),
    BadCase("targets not one per sample", "mse", FLOATS[:10], LoadError, ["one target per sample of x (64)"]),
    BadCase("unknown loss", "hinge", FLOATS, ConfigError, ["spec.training.loss: unknown loss 'hinge'"]),
    BadCase("loss module missing", "no_such_loss_module:make", FLOATS, LoadError,
            ["spec.training.loss: no_such_loss_module:make: cannot import 'no_such_loss_module'"]),
    BadCase("entry point is the loss itself", "usermodel:the_loss_itself", FLOATS, ConfigError,
            ["spec.training.loss: usermodel:the_loss_itself takes (output, target)", "must return the loss"],
            USER_CODE),
    BadCase("factory returns no callable", "usermodel:not_a_loss", FLOATS, LoadError,
            ["spec.training.loss: usermodel:not_a_loss returned int; expected a callable"], USER_CODE),
    BadCase("loss not a scalar", "usermodel:per_sample", FLOATS, LoadError,
            ["spec.training.loss: the loss of usermodel:per_sample returned a tensor of shape (48,)",
             "expected a scalar tensor"], USER_CODE, step=True),
    BadCase("classification factory on regression", "mse", FLOATS, ConfigError,
            ["spec.model.entrypoint: usermodel:classifier takes num_classes", "gets output_shape"],
            USER_CODE, model=Model(entrypoint="usermodel:classifier")),
    BadCase("model output not the target shape", "mse", FLOATS, ConfigError,
            ["spec.training.loss: mse needs the model's output in the targets' shape",
             "got output (48, 3), targets (48, 1)", "output_shape"],
            USER_CODE, step=True, model=Model(entrypoint="usermodel:wrong_width")),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
def test_bad_loss_target_or_model_combination_names_its_fields(case: BadCase, tmp_path: Path, code_dir) -> None:
    if case.user_code:
        (tmp_path / "usermodel.py").write_text(case.user_code)
    code_dir(tmp_path)
    with pytest.raises(case.error) as err:
        data = load_data(npz(tmp_path, X, case.y), seed=0, loss=case.loss)
        model = build_model(case.model, data.input_shape, data.num_classes, 0, output_shape=data.target_shape)
        assert case.step, "loaded without the error"
        train_step(model, build_optimizer(model.parameters(), Optimizer()), data.train_x, data.train_y, data.objective)
    message = str(err.value)
    assert all(w in message for w in case.words), message
    assert "\n" not in message


def test_builtin_models_shape_their_output_as_the_target() -> None:
    for name, input_shape in (("mlp", (5,)), ("cnn", (1, 4, 4))):
        for output_shape in ((1,), (3,), (2, 3)):
            model = build_model(Model(name=name), input_shape, None, 0, output_shape=output_shape)
            assert model(torch.zeros(4, *input_shape)).shape == (4, *output_shape)
    with pytest.raises(ValueError, match="num_classes or output_shape"):
        build_model(Model(name="mlp"), (5,), 3, 0, output_shape=(1,))


# --- where user code comes from ---------------------------------------------------------


IMPORT_PROBE = (
    "import sys\n"
    "from kubetrain.trainer.plugins import load_entrypoint\n"
    "print(load_entrypoint('probe_mod:where', 'spec.model.entrypoint')())\n"
)


@pytest.mark.parametrize("how", ["KUBETRAIN_CODE_DIR", "working directory"])
def test_entry_points_import_from_the_code_dir_without_pythonpath(tmp_path: Path, how: str) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "probe_mod.py").write_text("def where():\n    return 'found ' + __file__\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", CODE_DIR_VAR)}
    env["PYTHONSAFEPATH"] = "1"  # as every trainer runs: the working directory is not on sys.path by itself
    if how == "KUBETRAIN_CODE_DIR":  # kubetrain run: the manifest's directory
        env[CODE_DIR_VAR], cwd = str(code), tmp_path
    else:  # a cluster: the image's working directory
        cwd = code
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"found {code.resolve() / 'probe_mod.py'}"


def test_single_job_with_a_regression_dataset_and_builtin_model(tmp_path: Path, write_job, make_ctx,
                                                                 code_dir) -> None:
    code_dir(REGRESSION)
    job = write_job({
        "model": {"name": "mlp", "args": {"hidden": 64}},
        "dataset": {"name": None, "entrypoint": "curve_data:curve", "args": {"samples": 2048}},
        "training": {"epochs": None, "maxSteps": 300, "loss": "mse",
                     "optimizer": {"name": "adam", "learningRate": 0.01, "momentum": 0.0}},
    })
    assert run_single(make_ctx(job)) == EXIT_OK
    result = json.loads((tmp_path / "run" / "results" / "single-0.json").read_text())
    assert result["eval_accuracy"] is None
    assert result["eval_loss"] < 0.25 * mean_predictor_loss(load_one(job).spec.dataset, "mse"), result


def mean_predictor_loss(dataset: Dataset, loss: str) -> float:
    """The eval loss of predicting the training targets' mean: what a model must beat to have learnt."""
    data = load_data(dataset, seed=0, loss=loss)
    mean = data.train_y.mean(dim=0, keepdim=True).expand_as(data.eval_y)
    return float(data.objective.loss(mean, data.eval_y))


# --- the example, through the command line ---------------------------------------------


@pytest.mark.slow
def test_regression_example_trains_a_parameter_server_job_with_user_code(tmp_path: Path, code_dir,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = REGRESSION / "parameter-server.yaml"
    run = tmp_path / "run"
    # From elsewhere, no PYTHONPATH: the entry points import from the manifest's directory.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv(CODE_DIR_VAR, raising=False)
    proc = kubetrain("run", str(manifest), "--run-dir", str(run), "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    job = load_one(manifest)
    assert job.spec.training.loss == "curve_loss:log_cosh" and job.spec.mode == "ParameterServer"
    assert summary["state"] == "Succeeded"
    assert summary["eval_accuracy"] is None  # a regression loss: not measured
    code_dir(REGRESSION)
    baseline = mean_predictor_loss(job.spec.dataset, job.spec.training.loss)
    assert summary["eval_loss"] < 0.1 * baseline, (summary, baseline)
    [final] = read_events(run / "metrics" / "worker-0.jsonl", "eval")
    assert final["eval_accuracy"] is None and final["eval_loss"] == summary["eval_loss"]


@pytest.mark.slow
def test_ddp_job_trains_a_builtin_model_on_regression_targets(tmp_path: Path) -> None:
    x = RNG.uniform(-1, 1, (1024, 3)).astype(np.float32)
    np.savez(tmp_path / "wave.npz", x=x, y=np.sin(np.pi * x[:, 0]) + x[:, 1] * x[:, 2])
    dataset = {"path": str(tmp_path / "wave.npz"), "evalFraction": 0.2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_doc(
        "ddp-mse", mode="DDP", model={"name": "mlp", "args": {"hidden": 64}}, dataset=dataset,
        training={"loss": "mse", "epochs": 10, "batchSize": 32, "device": "cpu",
                  "optimizer": {"name": "adam", "learningRate": 0.01}},
        ddp={"nodes": 1, "procsPerNode": 2, "backend": "gloo"},
    )))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_accuracy"] is None
    assert summary["eval_loss"] < 0.25 * mean_predictor_loss(load_one(path).spec.dataset, "mse"), summary


def test_validate_finds_entry_points_next_to_the_manifest_without_running_them(tmp_path: Path) -> None:
    assert kubetrain("validate", str(REGRESSION / "parameter-server.yaml"), cwd=tmp_path).returncode == 0
    # A package whose __init__ must not run: finding a module is enough.
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("open(__file__ + '.ran', 'w').close()\nraise SystemExit(7)\n")
    (tmp_path / "mypkg" / "models.py").write_text("")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_doc("ok", model={"entrypoint": "mypkg.models:build"},
                                           training={"loss": "torch.nn:HuberLoss"})))
    proc = kubetrain("validate", str(path), cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "mypkg" / "__init__.py.ran").exists()


@pytest.mark.parametrize(
    "spec, field_path, module",
    [
        ({"model": {"entrypoint": "no_such_module_xyz.models:build"}}, "spec.model.entrypoint",
         "no_such_module_xyz.models"),
        ({"dataset": {"entrypoint": "mypkg.no_such_data:load"}}, "spec.dataset.entrypoint", "mypkg.no_such_data"),
        ({"training": {"loss": "no_such_loss_xyz:make"}}, "spec.training.loss", "no_such_loss_xyz"),
    ],
    ids=["model module", "dataset module in an existing package", "loss module"],
)
def test_validate_exits_2_naming_a_missing_entry_point_module(tmp_path: Path, spec: dict, field_path: str,
                                                               module: str) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_doc("missing", **spec)))
    proc = kubetrain("validate", str(path))
    assert proc.returncode == 2
    assert f"{path}: {field_path}: " in proc.stderr and f"cannot find module {module!r}" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Code that exists only in the job's image: the check can be left out.
    assert kubetrain("validate", "--no-code-check", str(path)).returncode == 0
