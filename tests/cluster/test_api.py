"""The CRD and the examples against the real API server: schema, defaults, CEL rules, explain."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from helpers.kube import install_crd
from kubetrain.api import from_object, podtemplate
from kubetrain.api.spec import DISK_SIZE_MESSAGE, PVC_CLAIM_MESSAGE, PVC_PATH_MESSAGE
from support import EXAMPLES, ROOT

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
    ("spares with a node range", {**base(), "spec": {"mode": "DDP", "ddp": {"nodes": 2, "maxNodes": 3,
                                                                          "faultTolerance": {"spareGroups": 1}}}},
     "ddp.faultTolerance.spareGroups: spare groups stand in for lost ones at a fixed ddp.nodes"),
    ("too many spares", {**base(), "spec": {"mode": "DDP", "ddp": {"faultTolerance": {"spareGroups": 17}}}},
     "spec.ddp.faultTolerance.spareGroups"),
    ("heartbeat too short", {**base(), "spec": {"mode": "DDP", "ddp": {"faultTolerance": {"heartbeatTimeoutSeconds": 0.1}}}},
     "spec.ddp.faultTolerance.heartbeatTimeoutSeconds"),
    ("metrics port", base(metrics={"port": 70000}), "spec.metrics.port"),
    ("storage size", base(checkpoint={"storage": {"size": "lots"}}), "spec.checkpoint.storage.size"),
    ("restart policy enum", base(restartPolicy={"policy": "Always"}), "spec.restartPolicy.policy"),
    ("name too long", {**base(), "metadata": {"name": "a" * 50}}, "metadata.name: must be at most 45 characters"),
    ("missing mode", {**base(), "spec": {}}, "spec.mode"),
    # Tenants, fourth pass (issue 58): Model.check's bounds, in the CRD's CEL with the validator's messages.
    *[(name, base(model={"name": "causal-lm", **model}, dataset={"path": "/d.jsonl", "format": "text"}), words)
      for name, model, words in (
          ("pretrained claim path out of the claim", {"pretrained": "pvc://models/llama/../../../../proc/self"},
           f"model.pretrained: {PVC_PATH_MESSAGE}"),
          ("pretrained claim path absolute", {"pretrained": "pvc://models//etc"}, f"model.pretrained: {PVC_PATH_MESSAGE}"),
          ("pretrained claim name past 253", {"pretrained": f"pvc://{'m' * 300}/llama"},
           f"model.pretrained: {PVC_CLAIM_MESSAGE}"),
          ("model disk past the most", {"pretrained": "s3://bucket/m/", "diskSize": "2Ti"},
           f"model.diskSize: {DISK_SIZE_MESSAGE}"),
          ("model disk zero", {"pretrained": "s3://bucket/m/", "diskSize": "0"}, f"model.diskSize: {DISK_SIZE_MESSAGE}"),
      )],
]


@pytest.mark.parametrize("name, doc, words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_rejected_by_the_api_server(cluster, ns, name, doc, words):
    done = apply(cluster, ns, doc, dry_run=True)
    assert done.returncode != 0, f"{name}: accepted"
    assert words in done.stderr, done.stderr


def test_a_model_within_its_bounds_is_accepted_and_its_disk_left_to_kubetrains_default(cluster, ns):
    """spec.model.diskSize is new since 0.1.0: the CRD gives it no default (an API server's default would reach
    0.1.0's operator, which refuses a field it does not know, during an upgrade), kubetrain applies 20Gi; one
    set is kept."""
    for name, pretrained, disk in (("claim-model", "pvc://models/llama/v2/", None), ("s3-model", "s3://bucket/m/", "8Gi")):
        model = {"name": "causal-lm", "pretrained": pretrained, **({"diskSize": disk} if disk else {})}
        doc = base(model=model, dataset={"path": "/d.jsonl", "format": "text"})
        doc["metadata"]["name"] = name
        done = apply(cluster, ns, doc)
        assert done.returncode == 0, done.stderr
        spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", name, "-o", "json"))["spec"]
        assert spec["model"].get("diskSize") == disk
        assert from_object(json.loads(cluster.kubectl("-n", ns, "get", "tj", name, "-o", "json"))).spec.model.disk_size \
            == (disk or "20Gi")


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
    # Issue 58: kubetrain's container names in every list of the template.
    ("container model-init", pod_template({"containers": [{"name": "model-init", "image": "busybox"}]}),
     f"{PT}.containers[0].name", podtemplate.INIT_CONTAINER_MESSAGE),
    ("init container trainer", pod_template({"initContainers": [{"name": "trainer", "image": "busybox"}]}),
     f"{PT}.initContainers[0].name", podtemplate.TRAINER_INIT_MESSAGE),
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


# Resource quantities (api/quantity.py): Kubernetes' grammar within its 64-bit milli-unit bound, the
# validator's message. The API server's path names a map's key as [cpu] where the validator's says .cpu.
QUANTITIES = [
    ("a million-digit exponent", base(resources={"worker": {"requests": {"cpu": "1e999999"}}}),
     "spec.resources.worker.requests[cpu]"),
    ("past 64-bit milli-units", base(resources={"ps": {"limits": {"memory": "9Ei"}}}), "spec.resources.ps.limits[memory]"),
    ("one milli-unit past", base(resources={"worker": {"limits": {"cpu": "9223372036854775808m"}}}),
     "spec.resources.worker.limits[cpu]"),
    ("an integer past", base(resources={"worker": {"limits": {"cpu": 9223372036854776}}}), "spec.resources.worker.limits[cpu]"),
    ("negative", base(resources={"worker": {"requests": {"cpu": "-1"}}}), "spec.resources.worker.requests[cpu]"),
    ("no quantity", base(resources={"worker": {"requests": {"memory": "lots"}}}), "spec.resources.worker.requests[memory]"),
    ("a three-digit exponent", base(resources={"worker": {"requests": {"cpu": "1.0e-100"}}}),
     "spec.resources.worker.requests[cpu]"),
    ("minResources", base(runPolicy={"schedulingPolicy": {"minResources": {"cpu": "1e999999"}}}),
     "spec.runPolicy.schedulingPolicy.minResources[cpu]"),
    ("a sidecar's request", pod_template({"containers": [{"name": "side", "resources": {"requests": {"cpu": "1e999999"}}}]}),
     f"{PT}.containers[0].resources.requests[cpu]"),
    ("an init container's limit", pod_template({"initContainers": [{"name": "f", "resources": {"limits": {"cpu": "9Ei"}}}]}),
     f"{PT}.initContainers[0].resources.limits[cpu]"),
]


@pytest.mark.parametrize("name, doc, path", QUANTITIES, ids=[c[0] for c in QUANTITIES])
def test_a_quantity_past_kubernetes_bounds_is_refused_with_the_validators_message(cluster, ns, name, doc, path):
    from kubetrain.api import quantity

    done = apply(cluster, ns, doc, dry_run=True)
    assert done.returncode != 0, f"{name}: accepted"
    assert path in done.stderr and quantity.MESSAGE in done.stderr, done.stderr


def test_quantities_within_kubernetes_bounds_are_accepted_and_kept_as_written(cluster, ns):
    # Not 1e3 or 1e-9: PyYAML writes them unquoted (YAML 1.1 strings), kubectl reads numbers (1e-9 a float,
    # which an int-or-string refuses); 1.5e+3 is a float to PyYAML, so it is quoted.
    requests = {"a": "9223372036854775807m", "b": 9223372036854775, "c": "8Pi", "e": "500m", "f": ".5",
                "g": "1.5Gi", "h": "0", "i": "+2", "j": "1.", "k": "2P", "l": "1.5e+3", "m": 3}
    doc = base(resources={"worker": {"requests": requests, "claims": [{"name": "gpu"}]}},
               podTemplate={"spec": {"containers": [{"name": "side", "resources": {"limits": {"memory": "1Gi"}}}]}})
    doc["metadata"]["name"] = "quantities"
    done = apply(cluster, ns, doc)
    assert done.returncode == 0, done.stderr
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "quantities", "-o", "json"))["spec"]
    assert spec["resources"]["worker"] == {"requests": requests, "claims": [{"name": "gpu"}]}


# The chart's admission policy (a ValidatingAdmissionPolicy, rendered by helm from the generated rules):
# the PodGroup's priority needs the priorityClass allowance, its queue must be one the chart lists.

@pytest.fixture(scope="module")
def policed(cluster, ns):
    """A namespace under the chart's policy for a release listing the Volcano queue `research`."""
    import time

    name = f"{ns}-gang"
    cluster.kubectl("create", "namespace", name)
    release = f"gang-{uuid.uuid4().hex[:6]}"
    rendered = cluster.run("helm", "template", release, str(ROOT / "charts" / "kubetrain"), "--namespace", name,
                           "--set", "operator.namespaced=true", "--set", "gangScheduling.volcano.queues={research}")
    objs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"].startswith("ValidatingAdmissionPolicy")]
    cluster.run("kubectl", "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    probe = base(runPolicy={"schedulingPolicy": {"queue": "not-listed"}})
    deadline = time.monotonic() + 60
    while apply(cluster, name, probe, dry_run=True).returncode == 0:
        assert time.monotonic() < deadline, "the chart's policy is not enforced after 60 s"
        time.sleep(0.5)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")
    for obj in objs:
        cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


@pytest.mark.parametrize("field, value", [("queue", "team-b"), ("priorityClass", "system-cluster-critical")])
def test_the_chart_policy_refuses_another_teams_queue_or_a_podgroup_priority_with_the_validators_message(
        cluster, policed, field, value, tmp_path, capsys):
    from kubetrain.cli import main

    doc = base(runPolicy={"schedulingPolicy": {"gangScheduler": "volcano", field: value}})
    done = apply(cluster, policed, doc, dry_run=True)
    assert done.returncode != 0, f"{field} {value}: accepted"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", "--no-code-check", "--volcano-queues", "research", str(path)]) == 2
    [says] = [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines()
              if f"spec.runPolicy.schedulingPolicy.{field}:" in line]
    assert says in done.stderr, done.stderr  # the same path and message


def test_the_chart_policy_accepts_a_listed_queue_and_volcanos_default(cluster, policed):
    for policy in ({"gangScheduler": "volcano", "queue": "research"}, {"gangScheduler": "volcano"}, {}):
        done = apply(cluster, policed, base(runPolicy={"schedulingPolicy": policy}), dry_run=True)
        assert done.returncode == 0, done.stderr


def test_a_null_the_schema_declares_is_dropped_or_refused_and_a_free_form_one_is_kept(cluster, ns):
    """What the API server does with a null, which kubetrain refuses anywhere in spec but where an optional
    field is unset (tests/api/test_validate.py): in a field the CRD declares (a typed one, the template's
    labels, a role's requests and limits) a create drops it and a server-side apply refuses it; in a
    free-form one (model.args, the template's spec) it is kept, and the operator fails the job naming it
    (tests/operator/test_tenants.py)."""
    declared = {"resources": {"worker": {"limits": None, "requests": {"cpu": "1"}}},
                "podTemplate": {"metadata": {"labels": None}}, "training": {"batchSize": None}}
    doc = base(**declared)
    doc["metadata"]["name"] = "nulls-declared"
    done = apply(cluster, ns, doc, dry_run=True)
    assert done.returncode != 0 and "spec.resources.worker.limits" in done.stderr, done.stderr
    cluster.kube(ns).run("create", "-f", "-", input=json.dumps(doc))
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "nulls-declared", "-o", "json"))["spec"]
    assert spec["resources"]["worker"] == {"requests": {"cpu": "1"}} and spec["podTemplate"] == {"metadata": {}}
    assert spec["training"]["batchSize"] == 64  # dropped, then defaulted

    free = base(model={"name": "mlp", "args": {"hidden": None}}, podTemplate={"spec": {"nodeSelector": None}},
                runPolicy={"schedulingPolicy": {"minAvailable": None}})  # the last: an optional field, nullable
    free["metadata"]["name"] = "nulls-kept"
    cluster.kube(ns).run("create", "-f", "-", input=json.dumps(free))
    spec = json.loads(cluster.kubectl("-n", ns, "get", "tj", "nulls-kept", "-o", "json"))["spec"]
    assert spec["model"]["args"] == {"hidden": None} and spec["podTemplate"]["spec"] == {"nodeSelector": None}
    assert spec["runPolicy"]["schedulingPolicy"]["minAvailable"] is None
