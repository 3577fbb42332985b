"""The CRD and the examples against the real API server: schema, defaults, CEL rules, explain."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from helpers.kube import install_crd
from kubetrain_operator.api import podtemplate
from support import EXAMPLES

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ns(cluster):
    install_crd(cluster)
    name = f"api-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def apply(cluster, ns, doc: dict, dry_run: bool = False) -> subprocess.CompletedProcess:
    return cluster.kube(ns).apply(doc, server_side=True, dry_run=dry_run, check=False, timeout=60)


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_accepted_by_the_api_server(cluster, ns, example):
    done = apply(cluster, ns, yaml.safe_load(example.read_text()), dry_run=True)
    assert done.returncode == 0, done.stderr


def test_the_api_server_fills_the_defaults(cluster, ns):
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "defaults"},
           "spec": {"mode": "ParameterServer", "parameterServer": {}, "training": {}}}
    done = apply(cluster, ns, doc)
    assert done.returncode == 0, done.stderr
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "defaults", "-o", "json"))["spec"]
    assert spec["parameterServer"]["workers"] == 2
    assert spec["parameterServer"]["compression"]["algorithm"] == "None"
    assert spec["training"]["optimizer"]["learningRate"] == 0.05  # a block that is there gets its defaults
    assert spec["checkpoint"]["storage"]["accessMode"] == "ReadWriteOnce"
    # model, dataset and training belong to the built-in loops: the API server leaves an
    # absent one absent (a script job must be able to leave them out); kubetrain fills them.
    assert "model" not in spec and "dataset" not in spec


def test_a_script_job_is_accepted_and_refused_with_the_validators_messages(cluster, ns):
    script = {"command": ["python", "train.py"], "args": ["--steps", "5"]}
    ok = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "script"},
          "spec": {"mode": "DDP", "script": script}}
    done = apply(cluster, ns, ok)
    assert done.returncode == 0, done.stderr
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "script", "-o", "json"))["spec"]
    assert spec["script"] == {**script, "workingDir": ""} and "model" not in spec
    for extra, words in ((dict(model={"name": "cnn"}), "model: applies to a script job only as a pretrained model"),
                         (dict(dataset={"name": "digits"}), "dataset, training do not apply when script is set"),
                         (dict(mode="ParameterServer"), "script jobs run in mode Single or DDP"),
                         (dict(script={"command": []}), "spec.script.command")):
        bad = {**ok, "metadata": {"name": "script-bad"}, "spec": {**ok["spec"], **extra}}
        done = apply(cluster, ns, bad)
        assert done.returncode != 0 and words in done.stderr, done.stderr


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
    ("quorum above the nodes", {**base(), "spec": {"mode": "DDP", "ddp": {"nodes": 2, "faultTolerance": {"minReplicas": 3}}}},
     "ddp.faultTolerance.minReplicas: must be at most ddp.minNodes"),
    ("hook with fault tolerance", {**base(), "spec": {"mode": "DDP", "ddp": {"commHook": "FP16", "faultTolerance": {}}}},
     "ddp.commHook: faultTolerance averages gradients through torchft's Manager"),
    ("heartbeat too short", {**base(), "spec": {"mode": "DDP", "ddp": {"faultTolerance": {"heartbeatTimeoutSeconds": 0.1}}}},
     "spec.ddp.faultTolerance.heartbeatTimeoutSeconds"),
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


def pod_template(spec: dict) -> dict:
    return base(podTemplate={"spec": spec})


def trainer(name: str | None = "trainer", **container) -> dict:
    return pod_template({"containers": [{**({"name": name} if name else {}), **container}]})


PT = "spec.podTemplate.spec"
# kubetrain's own names in spec.podTemplate, refused by the CRD's CEL with the
# validator's messages (api/podtemplate.py); the API server's path stops at the
# list for the rules on a container (a CEL fieldPath cannot name the item).
COLLISIONS = [
    ("volume data", pod_template({"volumes": [{"name": "data", "emptyDir": {}}]}),
     f"{PT}.volumes[0].name", podtemplate.volume_message("data")),
    ("volume tmp second", pod_template({"volumes": [{"name": "dataset", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]}),
     f"{PT}.volumes[1].name", podtemplate.volume_message("tmp")),
    ("env KUBETRAIN_", trainer(env=[{"name": "OK", "value": "1"}, {"name": "KUBETRAIN_RUN_DIR", "value": "/x"}]),
     f"{PT}.containers[0].env", podtemplate.env_message("KUBETRAIN_RUN_DIR")),
    ("env HOME in a nameless container", trainer(None, env=[{"name": "HOME", "value": "/home/me"}]),
     f"{PT}.containers[0].env", podtemplate.env_message("HOME")),
    ("mount name", trainer(volumeMounts=[{"name": "data", "mountPath": "/ckpt"}]),
     f"{PT}.containers[0].volumeMounts", podtemplate.mount_name_message("data")),
    ("mount path", trainer(volumeMounts=[{"name": "scratch", "mountPath": "/tmp/"}]),
     f"{PT}.containers[0].volumeMounts", podtemplate.mount_path_message("/tmp")),
    ("port", trainer(ports=[{"name": "metrics", "containerPort": 8000}]),
     f"{PT}.containers[0].ports", podtemplate.port_message("metrics")),
    ("too many volumes", pod_template({"volumes": [{"name": f"v{i}", "emptyDir": {}} for i in range(podtemplate.MAX_VOLUMES + 1)]}),
     f"{PT}.volumes", "Too many"),
    # Issue 31: a job's template may not file its pods under another job of the namespace.
    ("label kubetrain.dev/job-name", base(podTemplate={"metadata": {"labels": {"kubetrain.dev/job-name": "victim"}}}),
     "spec.podTemplate.metadata.labels", podtemplate.reserved_key_message("kubetrain.dev/job-name")),
    ("label managed-by", base(podTemplate={"metadata": {"labels": {"team": "a", "app.kubernetes.io/managed-by": "x"}}}),
     "spec.podTemplate.metadata.labels", podtemplate.reserved_key_message("app.kubernetes.io/managed-by")),
    ("annotation kubetrain.dev/size", base(podTemplate={"metadata": {"annotations": {"kubetrain.dev/size": "9"}}}),
     "spec.podTemplate.metadata.annotations", podtemplate.reserved_key_message("kubetrain.dev/size")),
    ("label value not a string", base(podTemplate={"metadata": {"labels": {"team": 1}}}),
     "spec.podTemplate.metadata.labels.team", "expected string"),
]


@pytest.mark.parametrize("name, doc, path, message", COLLISIONS, ids=[c[0] for c in COLLISIONS])
def test_kubetrains_own_names_in_the_pod_template_are_refused(cluster, ns, name, doc, path, message):
    done = apply(cluster, ns, doc, dry_run=True)
    assert done.returncode != 0, f"{name}: accepted"
    assert path in done.stderr and message in done.stderr, done.stderr


def test_a_pod_template_with_its_own_volumes_is_accepted_and_kept_whole(cluster, ns):
    """A dataset volume filled by an init container, mounted by the trainer; a sidecar with any names.

    Nothing the schema leaves undeclared is pruned: every field comes back as written.
    """
    template = {
        "metadata": {"labels": {"team": "vision"}},
        "spec": {
            "nodeSelector": {"disk": "ssd"},
            "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "echo > /dataset/x"],
                                "volumeMounts": [{"name": "dataset", "mountPath": "/dataset"}]}],
            "volumes": [{"name": "dataset", "emptyDir": {"sizeLimit": "1Gi"}}],
            "containers": [
                {"name": "trainer", "env": [{"name": "DATASET_DIR", "value": "/dataset"}],
                 "volumeMounts": [{"name": "dataset", "mountPath": "/dataset", "readOnly": True}],
                 "ports": [{"name": "profiler", "containerPort": 6006}]},
                {"name": "uploader", "image": "busybox:1.36",
                 "env": [{"name": "HOME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                 "volumeMounts": [{"name": "data", "mountPath": "/kubetrain/data", "readOnly": True}],
                 "ports": [{"name": "metrics", "containerPort": 9100}]},
            ],
        },
    }
    doc = base(podTemplate=template)
    doc["metadata"]["name"] = "own-volumes"
    done = apply(cluster, ns, doc)
    assert done.returncode == 0, done.stderr
    stored = json.loads(cluster.kubectl("-n", ns, "get", "tj", "own-volumes", "-o", "json"))["spec"]["podTemplate"]
    assert stored == template


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
