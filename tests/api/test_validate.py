"""`kubetrain validate`: every invalid manifest named by its field path, exit 2, no traceback."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kubetrain_operator.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def base(mode: str = "Single") -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"}, "spec": {"mode": mode}}


def with_spec(mode: str = "Single", **spec) -> dict:
    doc = base(mode)
    doc["spec"].update(spec)
    return doc


@dataclass
class Case:
    name: str
    doc: object  # a dict, or raw text
    path: str  # the field path the message must name
    words: str = ""  # text the message must contain


CASES = [
    Case("yaml syntax", "spec: [\n", "(file)", "YAML syntax error at line"),
    Case("not an object", "- 1\n- 2\n", "(document)", "must be a TrainingJob"),
    Case("wrong apiVersion", {**base(), "apiVersion": "kubeflow.org/v1"}, "apiVersion", "kubetrain.dev/v1alpha1"),
    Case("wrong kind", {**base(), "kind": "PyTorchJob"}, "kind", "TrainingJob"),
    Case("missing name", {**base(), "metadata": {}}, "metadata.name", "required"),
    Case("name not DNS-1035", {**base(), "metadata": {"name": "My_Job"}}, "metadata.name", "DNS-1035"),
    Case("name starts with digit", {**base(), "metadata": {"name": "1job"}}, "metadata.name", "DNS-1035"),
    Case("name too long", {**base(), "metadata": {"name": "a" * 50}}, "metadata.name", "at most 45"),
    Case("missing spec", {k: v for k, v in base().items() if k != "spec"}, "spec", "required"),
    Case("missing mode", {**base(), "spec": {}}, "spec.mode", "required"),
    Case("unknown mode", with_spec(mode="Horovod"), "spec.mode", "one of Single, ParameterServer, DDP"),
    Case("mode case", with_spec(mode="ddp"), "spec.mode", "did you mean 'DDP'"),
    Case("unknown top field", {**base(), "specs": {}}, "specs", "unknown field"),
    Case("unknown spec field", with_spec(trainig={}), "spec.trainig", "did you mean 'training'"),
    Case("unknown nested field", with_spec(training={"batchSzie": 4}), "spec.training.batchSzie", "did you mean 'batchSize'"),
    Case("batch size zero", with_spec(training={"batchSize": 0}), "spec.training.batchSize", "at least 1, got 0"),
    Case("batch size string", with_spec(training={"batchSize": "64"}), "spec.training.batchSize", "integer"),
    Case("batch size bool", with_spec(training={"batchSize": True}), "spec.training.batchSize", "integer"),
    Case("epochs and maxSteps", with_spec(training={"epochs": 2, "maxSteps": 10}), "spec.training", "only one of epochs, maxSteps"),
    Case("learning rate zero", with_spec(training={"optimizer": {"learningRate": 0}}), "spec.training.optimizer.learningRate", "greater than 0"),
    Case("momentum one", with_spec(training={"optimizer": {"momentum": 1.0}}), "spec.training.optimizer.momentum", "less than 1"),
    Case("unknown optimizer", with_spec(training={"optimizer": {"name": "lamb"}}), "spec.training.optimizer.name", "sgd, adam"),
    Case("unknown device", with_spec(training={"device": "tpu"}), "spec.training.device", "auto, cpu, cuda"),
    Case("model name and entrypoint", with_spec(model={"name": "mlp", "entrypoint": "a.b:c"}), "spec.model", "only one of name, entrypoint"),
    Case("model neither", with_spec(model={"args": {}}), "spec.model", "one of name, entrypoint must be set"),
    Case("unknown model", with_spec(model={"name": "resnet"}), "spec.model.name", "mlp, cnn"),
    Case("bad entrypoint", with_spec(model={"entrypoint": "not an entrypoint"}), "spec.model.entrypoint", "package.module:function"),
    Case("dataset two sources", with_spec(dataset={"name": "digits", "path": "x.npz"}), "spec.dataset", "only one of name, path, entrypoint"),
    Case("eval fraction", with_spec(dataset={"name": "digits", "evalFraction": 1.5}), "spec.dataset.evalFraction", "at most 0.9"),
    Case("ps block in Single", with_spec(parameterServer={"workers": 2}), "spec", "parameterServer may be set only when mode is ParameterServer"),
    Case("ddp block in PS", with_spec(mode="ParameterServer", ddp={}), "spec", "ddp may be set only when mode is DDP"),
    Case("workers zero", with_spec(mode="ParameterServer", parameterServer={"workers": 0}), "spec.parameterServer.workers", "at least 1, got 0"),
    Case("aggregation", with_spec(mode="ParameterServer", parameterServer={"aggregation": "Semi"}), "spec.parameterServer.aggregation", "Sync, Async"),
    Case("compression", with_spec(mode="ParameterServer", parameterServer={"compression": {"algorithm": "topk"}}), "spec.parameterServer.compression.algorithm", "did you mean 'TopK'"),
    Case("topk ratio", with_spec(mode="ParameterServer", parameterServer={"compression": {"ratio": 0}}), "spec.parameterServer.compression.ratio", "greater than 0"),
    Case("sync timeout", with_spec(mode="ParameterServer", parameterServer={"syncTimeoutSeconds": -1}), "spec.parameterServer.syncTimeoutSeconds", "greater than 0"),
    Case("ddp backend", with_spec(mode="DDP", ddp={"backend": "mpi"}), "spec.ddp.backend", "gloo, nccl"),
    Case("nccl on cpu", with_spec(mode="DDP", ddp={"backend": "nccl"}, training={"device": "cpu"}), "spec.ddp.backend", "nccl needs GPUs"),
    Case("ddp shared claim", with_spec(mode="DDP", checkpoint={"storage": {"existingClaim": "ckpt"}}), "spec.checkpoint.storage.accessMode", "ReadWriteMany"),
    Case("restart policy", with_spec(restartPolicy={"policy": "Always"}), "spec.restartPolicy.policy", "OnFailure, ExitCode, Never"),
    Case("backoff negative", with_spec(restartPolicy={"backoffLimit": -1}), "spec.restartPolicy.backoffLimit", "at least 0"),
    Case("suspend string", with_spec(runPolicy={"suspend": "yes"}), "spec.runPolicy.suspend", "true or false"),
    Case("clean pod policy", with_spec(runPolicy={"cleanPodPolicy": "Some"}), "spec.runPolicy.cleanPodPolicy", "All, Running, None"),
    Case("metrics port", with_spec(metrics={"port": 70000}), "spec.metrics.port", "at most 65535"),
    Case("checkpoint interval", with_spec(checkpoint={"intervalSteps": 0}), "spec.checkpoint.intervalSteps", "at least 1"),
    Case("storage size", with_spec(checkpoint={"storage": {"size": "lots"}}), "spec.checkpoint.storage.size", "quantity"),
    Case("resources key", with_spec(resources={"worker": {"limit": {}}}), "spec.resources.worker.limit", "limits, requests"),
    Case("null mode", with_spec(mode=None), "spec.mode", "must not be null"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_invalid_manifest_is_rejected_with_its_field_path(case, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(case.doc if isinstance(case.doc, str) else yaml.safe_dump(case.doc))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{path}: {case.path}: ")]
    assert lines, f"no message names {case.path}:\n{err}"
    assert any(case.words in line for line in lines), err
    assert "Traceback" not in err


def test_all_problems_are_reported_at_once(tmp_path, capsys):
    doc = with_spec(training={"batchSize": 0, "epochs": -1, "optimizer": {"name": "x"}}, metrics={"port": -2})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 2
    paths = {line.split(": ")[1] for line in capsys.readouterr().err.splitlines()}
    assert paths == {"spec.training.batchSize", "spec.training.epochs", "spec.training.optimizer.name", "spec.metrics.port"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_are_valid(example, capsys):
    assert main(["validate", str(example)]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")


def test_validate_command_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_spec(training={"batchSize": 0})))
    proc = subprocess.run(
        [sys.executable, "-m", "kubetrain_operator.cli", "validate", str(bad), str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert f"{bad}: spec.training.batchSize: must be at least 1, got 0" in proc.stderr
    assert f"{tmp_path / 'missing.yaml'}: (file): no such file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_are_filled():
    from kubetrain_operator.api import from_object

    job = from_object(with_spec(mode="ParameterServer"))
    assert job.spec.parameter_server.workers == 2
    assert job.spec.parameter_server.compression.algorithm == "None"
    assert job.spec.training.epochs == 10
    assert job.spec.ddp is None
    assert from_object(with_spec(mode="DDP")).spec.ddp.nodes == 2
