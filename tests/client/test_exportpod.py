"""The export pod of a cluster job: which claims it mounts where, and that it is a pod the cluster admits."""

from __future__ import annotations

import pytest

from kubetrain.api import from_object
from kubetrain.client.exportpod import EXPORT_ROOT, LABEL_EXPORT, checkpoint_claims, export_pod
from kubetrain.engine.children import LABEL_JOB, claims


def job(mode: str, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "team"}, "spec": {"mode": mode, **spec}})


@pytest.mark.parametrize("name, spec, expected", [
    ("single", job("Single"), [("single-0", "j-ckpt-single-0", "checkpoints")]),
    ("two shards", job("ParameterServer", parameterServer={"replicas": 2, "workers": 2}),
     [("ps-0", "j-ckpt-ps-0", "checkpoints"), ("ps-1", "j-ckpt-ps-1", "checkpoints")]),
    ("ddp, a volume per node", job("DDP", ddp={"nodes": 2}),
     [("ddp-0", "data-j-ddp-0", "checkpoints"), ("ddp-1", "data-j-ddp-1", "checkpoints")]),
    ("ddp, one shared claim", job("DDP", ddp={"nodes": 2}, checkpoint={"storage": {"accessMode": "ReadWriteMany"}}),
     [("ddp-0", "j-ckpt-ddp", "checkpoints")]),
    ("an existing claim", job("ParameterServer", checkpoint={"storage": {"existingClaim": "shared"}}),
     [("ps-0", "shared", "j/checkpoints/ps-0")]),
])
def test_the_claims_that_hold_checkpoints_are_the_ones_the_operator_makes(name, spec, expected):
    assert checkpoint_claims(spec) == expected
    made = {c["metadata"]["name"] for c in claims(spec, "uid")}
    # The operator's own claims (the StatefulSet's per-node ones are its volumeClaimTemplates' instead).
    assert {claim for _, claim, _ in expected if not claim.startswith("data-")} <= made | {"shared"}


def test_the_export_pod_mounts_them_read_only_on_the_jobs_nodes_and_is_no_replica():
    spec = job("ParameterServer", parameterServer={"replicas": 2, "workers": 2},
               podTemplate={"spec": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "k", "operator": "Exists"}],
                                     "containers": [{"name": "trainer", "env": [{"name": "A", "value": "b"}]}]}})
    pod = export_pod(spec, "j-export-1", "img:1")
    assert pod["metadata"]["labels"] == {LABEL_EXPORT: "j"} and LABEL_JOB not in pod["metadata"]["labels"]
    podspec = pod["spec"]
    assert podspec["nodeSelector"] == {"pool": "gpu"} and podspec["tolerations"][0]["key"] == "k"
    assert all(v["persistentVolumeClaim"]["readOnly"] for v in podspec["volumes"] if "persistentVolumeClaim" in v)
    mounts = {m["mountPath"]: m for m in podspec["containers"][0]["volumeMounts"]}
    assert {f"{EXPORT_ROOT}/ps-0", f"{EXPORT_ROOT}/ps-1"} <= mounts.keys()
    assert all(m["readOnly"] for path, m in mounts.items() if path.startswith(EXPORT_ROOT))
    container = podspec["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] and podspec["securityContext"]["runAsNonRoot"]
    assert podspec["activeDeadlineSeconds"] > 0 and podspec["automountServiceAccountToken"] is False


def test_a_job_in_object_storage_is_exported_with_its_own_credentials_and_no_claim():
    spec = job("DDP", ddp={"nodes": 2, "strategy": "FSDP"},
               checkpoint={"storage": {"uri": "s3://ckpt/jobs/j/", "secretRef": "s3-creds"}})
    assert checkpoint_claims(spec) == []
    pod = export_pod(spec, "j-export-1", "img:1")
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["tmp"]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY", "optional": False}
    assert "AWS_ACCESS_KEY_ID" in env and "value" not in env["AWS_ACCESS_KEY_ID"]


def test_a_fine_tune_s_export_pod_reads_its_pretrained_claim_and_the_client_unpacks_the_directory(tmp_path):
    """A Hugging Face export copies the pretrained config and tokenizer: a pvc:// model's claim is mounted
    read-only where the job's pods have it. The directory leaves the pod as one tar stream, unpacked into the
    new directory with tarfile's data filter (no path out of it)."""
    import io
    import tarfile

    from kubetrain.client.cluster_backend import unpack

    spec = job("Single", model={"name": "causal-lm", "pretrained": "pvc://models/base"},
               dataset={"path": "/data/t.jsonl", "format": "text"})
    pod = export_pod(spec, "j-export-1", "img:1")
    assert {"name": "pretrained", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in \
        pod["spec"]["volumes"]
    assert {"name": "pretrained", "mountPath": "/kubetrain/pretrained", "readOnly": True} in \
        pod["spec"]["containers"][0]["volumeMounts"]

    tar = tmp_path / "model.tar"
    with tarfile.open(tar, "w") as archive:
        for name, data in (("./config.json", b"{}"), ("./model.safetensors", b"weights")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    unpack(tar, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as archive:
        info = tarfile.TarInfo("../outside")
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.OutsideDestinationError):
        unpack(evil, tmp_path / "hf2")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "hf2").exists()


# --- Tenants, fourth pass: the operator's claim rule holds on the export's path too --------------------------------

def thief(claim: str):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "thief", "namespace": "team"},
                        "spec": {"mode": "Single", "image": "img:1", "checkpoint": {"storage": {"existingClaim": claim}}}})


def test_the_export_judges_another_jobs_claim_with_the_operators_rule_and_message():
    from kubetrain.client.exportpod import claim_problems
    from kubetrain.drivers.cluster import refusals
    from kubetrain.drivers.cluster.state import Controller, OperatorConfig

    operator = Controller(OperatorConfig(), scrape_tick=None)
    for claim, holder in (("victim-ckpt-single-0", None), ("shared", "victim")):
        if holder:
            operator.index.set_claim(("team", holder), claim, "Bound")
        refused = claim_problems(thief(claim), holder)
        assert refused and refused == refusals.claim_problems(operator, thief(claim))
        assert refused[0].startswith(f"spec.checkpoint.storage.existingClaim: '{claim}' is ")
    assert claim_problems(thief("thief-ckpt-single-0"), None) == []  # its own name's, kept from an earlier job
    assert claim_problems(thief("shared"), "thief") == [] and claim_problems(thief("shared"), None) == []


class Stop(Exception):
    """The fake API's answer to a pod's creation: the test ends there."""


class FakeCore:
    """CoreV1Api's calls an export makes before its pod runs: the claim's labels, the pod's creation."""

    def __init__(self, labels: dict | None):
        self.labels, self.created = labels, []

    def read_namespaced_persistent_volume_claim(self, name, namespace, **_):
        import json
        from types import SimpleNamespace

        from kubernetes.client.rest import ApiException

        if self.labels is None:
            err = ApiException(status=404, reason="Not Found")
            err.body = json.dumps({"message": f'persistentvolumeclaims "{name}" not found', "details": {"name": name}})
            raise err
        return SimpleNamespace(data=json.dumps({"metadata": {"name": name, "labels": self.labels}}))

    def create_namespaced_pod(self, namespace, body, **_):
        self.created.append(body)
        raise Stop


@pytest.mark.parametrize("claim, labels, refused", [
    ("victim-ckpt-single-0", None, "is named as job victim's checkpoint claim"),
    ("shared", {LABEL_JOB: "victim"}, "is job victim's checkpoint claim"),
    ("shared", {}, ""),
    ("shared", {LABEL_JOB: "thief"}, ""),
], ids=["named as another job's", "labelled as another job's", "the namespace's", "labelled as its own"])
def test_an_export_on_another_jobs_claim_is_refused_before_its_pod_is_made(claim, labels, refused):
    from kubernetes import client

    from kubetrain.client.api import ClientError
    from kubetrain.client.cluster_backend import ClusterBackend

    backend = ClusterBackend("team", api_client=client.ApiClient())
    backend.core = FakeCore(labels)
    backend.spec = lambda name: thief(claim)
    with pytest.raises(Stop if not refused else ClientError) as err:
        backend.export("thief", "/tmp/model.pt")
    if refused:
        assert str(err.value).startswith(f"thief: export: spec.checkpoint.storage.existingClaim: '{claim}' {refused}")
        assert "podSecurity.allow: [claims]" in str(err.value) and backend.core.created == []
    else:
        [pod] = backend.core.created
        assert pod["spec"]["volumes"][1]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}


def test_the_export_pod_takes_the_chiefs_cpu_memory_and_disk_not_its_accelerators():
    """A namespace whose ResourceQuota counts limits admits the export pod wherever it admits the job's pods."""
    limits = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1}
    for spec in (job("Single", podTemplate={"spec": {"containers": [{"name": "trainer", "resources": {"limits": limits}}]}}),
                 job("ParameterServer", resources={"ps": {"limits": {"cpu": "1"}}, "worker": {"limits": limits}}),
                 job("DDP", ddp={"nodes": 2}, resources={"worker": {"limits": limits}})):
        container = export_pod(spec, "j-export-1", "img:1")["spec"]["containers"][0]
        assert container["resources"] == {"limits": {"cpu": "4", "memory": "16Gi"}}
    assert "resources" not in export_pod(job("Single"), "j-export-1", "img:1")["spec"]["containers"][0]
