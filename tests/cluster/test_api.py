"""The CRD and the examples against the real API server: schema, defaults, CEL rules, explain."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from support import EXAMPLES, ROOT

pytestmark = pytest.mark.cluster
CRD = ROOT / "deploy" / "crd" / "trainingjobs.yaml"


@pytest.fixture(scope="module")
def ns(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.dev", "--timeout=60s")
    name = f"api-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def apply(cluster, ns, doc: dict, dry_run: bool = False) -> subprocess.CompletedProcess:
    args = ["kubectl", "-n", ns, "apply", "--server-side", "-f", "-"]
    if dry_run:
        args.append("--dry-run=server")
    return subprocess.run(args, input=yaml.safe_dump(doc), env=cluster.env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_accepted_by_the_api_server(cluster, ns, example):
    done = apply(cluster, ns, yaml.safe_load(example.read_text()), dry_run=True)
    assert done.returncode == 0, done.stderr


def test_the_api_server_fills_the_defaults(cluster, ns):
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "defaults"},
           "spec": {"mode": "ParameterServer", "parameterServer": {}}}
    done = apply(cluster, ns, doc)
    assert done.returncode == 0, done.stderr
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "defaults", "-o", "json"))["spec"]
    assert spec["parameterServer"]["workers"] == 2
    assert spec["parameterServer"]["compression"]["algorithm"] == "None"
    assert spec["training"]["optimizer"]["learningRate"] == 0.05
    assert spec["model"] == {"name": "mlp"}
    assert spec["checkpoint"]["storage"]["accessMode"] == "ReadWriteOnce"


def base(**spec):
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bad"},
            "spec": {"mode": "Single", **spec}}


INVALID = [
    ("mode enum", base(mode="Horovod"), "spec.mode"),
    ("unknown ... batch size zero", base(training={"batchSize": 0}), "spec.training.batchSize"),
    ("learning rate zero", base(training={"optimizer": {"learningRate": 0}}), "spec.training.optimizer.learningRate"),
    ("optimizer enum", base(training={"optimizer": {"name": "lamb"}}), "spec.training.optimizer.name"),
    ("epochs and maxSteps", base(training={"epochs": 1, "maxSteps": 2}), "only one of epochs, maxSteps may be set"),
    ("model name and entrypoint", base(model={"name": "mlp", "entrypoint": "a.b:c"}), "exactly one of name, entrypoint must be set"),
    ("entrypoint pattern", base(model={"entrypoint": "not valid"}), "spec.model.entrypoint"),
    ("ps block in Single", base(parameterServer={"workers": 2}), "parameterServer may be set only when mode is ParameterServer"),
    ("ddp block in PS", {**base(), "spec": {"mode": "ParameterServer", "ddp": {}}}, "ddp may be set only when mode is DDP"),
    ("workers zero", {**base(), "spec": {"mode": "ParameterServer", "parameterServer": {"workers": 0}}}, "spec.parameterServer.workers"),
    ("compression enum", {**base(), "spec": {"mode": "ParameterServer", "parameterServer": {"compression": {"algorithm": "Zip"}}}}, "spec.parameterServer.compression.algorithm"),
    ("nccl on cpu", {**base(), "spec": {"mode": "DDP", "ddp": {"backend": "nccl"}, "training": {"device": "cpu"}}}, "nccl needs GPUs"),
    ("metrics port", base(metrics={"port": 70000}), "spec.metrics.port"),
    ("storage size", base(checkpoint={"storage": {"size": "lots"}}), "spec.checkpoint.storage.size"),
    ("restart policy enum", base(restartPolicy={"policy": "Always"}), "spec.restartPolicy.policy"),
    ("name too long", {**base(), "metadata": {"name": "a" * 50}}, "metadata.name: must be at most 45 characters"),
    ("missing mode", {**base(), "spec": {}}, "spec.mode"),
]


@pytest.mark.parametrize("name, doc, words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_rejected_by_the_api_server(cluster, ns, name, doc, words):
    done = apply(cluster, ns, doc, dry_run=True)
    assert done.returncode != 0, f"{name}: accepted"
    assert words in done.stderr, done.stderr


def test_immutable_mode(cluster, ns):
    doc = base()
    doc["metadata"]["name"] = "immutable"
    assert apply(cluster, ns, doc).returncode == 0
    doc["spec"]["mode"] = "DDP"
    done = apply(cluster, ns, doc)
    assert done.returncode != 0 and "mode is immutable" in done.stderr


def test_kubectl_explain_shows_the_field_docs(cluster, ns):
    out = cluster.kubectl("explain", "trainingjob.spec.parameterServer")
    assert "Parameter-server shards; parameters are balanced across them by bytes." in out
    assert "aggregation" in out and "compression" in out
