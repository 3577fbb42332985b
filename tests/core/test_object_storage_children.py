"""What a job with data and checkpoints in object storage owns in a cluster: no claim, each pod's own disk,
the credentials from its secretRef (never read by the operator), and the Secrets an installation lets a job
name, judged alike by the operator and `kubetrain validate`."""

from __future__ import annotations

import pytest
import yaml

from kubetrain.cli import main
from kubetrain.api import from_object
from kubetrain.engine import podsecurity
from kubetrain.engine.children import CREDENTIAL_KEYS, Settings, children
from kubetrain.engine.plan import checkpoint_uri

STORE = {"uri": "s3://ckpt/jobs/j/", "secretRef": "s3-creds"}
DATA = {"uri": "s3://data/digits/", "secretRef": "s3-creds"}


def job(mode: str, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"},
                        "spec": {"mode": mode, "checkpoint": {"storage": STORE}, **spec}})


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("mode,spec", [
    ("Single", {"dataset": DATA}),
    ("ParameterServer", {"dataset": DATA, "parameterServer": {"replicas": 2, "workers": 2}}),
    ("DDP", {"dataset": DATA, "ddp": {"nodes": 3, "strategy": "FSDP"}}),
    ("DDP", {"script": {"command": ["python", "train.py"]}, "ddp": {"nodes": 2, "faultTolerance": {}}}),
], ids=["single", "ps", "fsdp", "fault-tolerant-script"])
def test_no_claim_is_made_and_each_pod_stages_on_its_own_disk(mode, spec):
    objs = children(job(mode, **spec), "uid-1", "tok")
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    pods = [o["spec"] for o in objs if o["kind"] == "Pod"]
    pods += [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "StatefulSet"]
    assert not any(o["spec"].get("volumeClaimTemplates") for o in objs if o["kind"] == "StatefulSet")
    for pod in pods:
        data = next(v for v in pod["volumes"] if v["name"] == "data")
        assert data == {"name": "data", "emptyDir": {}}
        env = env_of(pod["containers"][0])
        if env["KUBETRAIN_REPLICA"]["value"] == "lighthouse-0":
            assert "AWS_SECRET_ACCESS_KEY" not in env  # a Lighthouse never touches the store
            continue
        # The credentials: references the kubelet resolves, never values the operator read.
        for key, required in CREDENTIAL_KEYS:
            assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": key,
                                                                              "optional": not required}}}
        assert env["KUBETRAIN_CHECKPOINT_URI"]["value"].startswith("s3://ckpt/jobs/j/")


def test_replicas_get_a_prefix_each_a_ddp_group_shares_one_and_fault_tolerant_groups_keep_their_own():
    assert checkpoint_uri(job("Single"), "single-0") == "s3://ckpt/jobs/j/single-0/"
    ps = job("ParameterServer")
    assert [checkpoint_uri(ps, f"ps-{i}") for i in range(2)] == ["s3://ckpt/jobs/j/ps-0/", "s3://ckpt/jobs/j/ps-1/"]
    assert checkpoint_uri(job("DDP"), "ddp-1") == "s3://ckpt/jobs/j/ddp-0/"
    ft = job("DDP", ddp={"nodes": 2, "faultTolerance": {}})
    sts = next(o for o in children(ft, "u", "t") if o["kind"] == "StatefulSet")
    env = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    assert env["KUBETRAIN_CHECKPOINT_URI"]["value"] == "s3://ckpt/jobs/j/ddp-$(KUBETRAIN_NODE_RANK)/"
    plain = next(o for o in children(job("DDP"), "u", "t") if o["kind"] == "StatefulSet")
    assert env_of(plain["spec"]["template"]["spec"]["containers"][0])["KUBETRAIN_CHECKPOINT_URI"]["value"] == \
        "s3://ckpt/jobs/j/ddp-0/"


def test_a_job_names_only_the_secrets_the_installation_lets_it_name():
    spec = {"dataset": DATA}
    refused = podsecurity.problems(job("Single", **spec), Settings())
    assert refused == [
        "spec.checkpoint.storage.secretRef: Secret 's3-creds' is not one this kubetrain installation lets jobs name "
        "as object-storage credentials (the chart's objectStorage.secrets lists them, now none; "
        "podSecurity.allow: [secrets] allows any)",
        "spec.dataset.secretRef: Secret 's3-creds' is not one this kubetrain installation lets jobs name as "
        "object-storage credentials (the chart's objectStorage.secrets lists them, now none; "
        "podSecurity.allow: [secrets] allows any)",
    ]
    assert podsecurity.problems(job("Single", **spec), Settings(object_store_secrets=frozenset({"s3-creds"}))) == []
    assert podsecurity.problems(job("Single", **spec), Settings(pod_security_allow=frozenset({"secrets"}))) == []
    other = podsecurity.problems(job("Single", **spec), Settings(object_store_secrets=frozenset({"team-a"})))
    assert len(other) == 2 and "lists them: team-a;" in other[0]


def test_validate_judges_secret_refs_as_the_operator_does(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                                    "metadata": {"name": "j"},
                                    "spec": {"mode": "Single", "checkpoint": {"storage": STORE}}}))
    assert main(["validate", "--no-code-check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.checkpoint.storage.secretRef: Secret 's3-creds' is not one this kubetrain installation" in err
    assert main(["validate", "--no-code-check", "--object-store-secrets", "s3-creds", str(path)]) == 0
    assert main(["validate", "--no-code-check", "--allow", "secrets", str(path)]) == 0
    with pytest.raises(SystemExit) as bad:
        main(["validate", "--object-store-secrets", "Not_A_Name", str(path)])
    assert bad.value.code == 2
    assert "'Not_A_Name' is not a Secret name" in capsys.readouterr().err
