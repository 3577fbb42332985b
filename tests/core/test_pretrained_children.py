"""What a fine-tuning job (spec.model.pretrained) adds to its pods: the init container that fetches and checks
the model before the trainer starts, the model's volume (the pod's own disk, or the named claim, read-only),
the trainer's read-only mount and KUBETRAIN_MODEL_DIR; a pvc:// model only where the installation allows
claims; and kubetrain's own init container and volumes kept from a template."""

from __future__ import annotations

from kubetrain.api import from_object
from kubetrain.api.podtemplate import pod_template_problems
from kubetrain.engine import podsecurity
from kubetrain.engine.children import Settings, children

TEXT = {"uri": "s3://data/text/", "format": "text", "secretRef": "s3-creds"}


def job(mode: str, pretrained: str, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"},
                        "spec": {"mode": mode, "dataset": TEXT, **spec,
                                 "model": {"name": "causal-lm", "pretrained": pretrained,
                                           **({"secretRef": "s3-creds"} if pretrained.startswith("s3://") else {})}}})


def pod_specs(objs: list[dict]) -> list[dict]:
    return ([o["spec"] for o in objs if o["kind"] == "Pod"]
            + [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "StatefulSet"])


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_an_object_storage_model_is_fetched_by_an_init_container_onto_the_pods_own_disk():
    for mode, extra in (("Single", {}), ("DDP", {"ddp": {"nodes": 2, "strategy": "FSDP"},
                                                 "checkpoint": {"storage": {"uri": "s3://ckpt/jobs/j/",
                                                                            "secretRef": "s3-creds"}}})):
        [spec] = pod_specs(children(job(mode, "s3://models/base/", **extra), "uid", "tok"))
        [init] = spec["initContainers"]
        trainer = spec["containers"][0]
        assert init["name"] == "model-init" and init["command"] == ["python", "-m", "kubetrain.trainer", "initializer"]
        assert init["image"] == trainer["image"]
        assert {"name": "model", "emptyDir": {}} in spec["volumes"]
        assert {"name": "model", "mountPath": "/kubetrain/model"} in init["volumeMounts"]
        assert {"name": "model", "mountPath": "/kubetrain/model", "readOnly": True} in trainer["volumeMounts"]
        for container in (init, trainer):
            env = env_of(container)
            assert env["KUBETRAIN_MODEL_DIR"] == "/kubetrain/model"
            assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3-creds", "key":
                                                                     "AWS_SECRET_ACCESS_KEY", "optional": False}}
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and security["capabilities"] == {"drop": ["ALL"]}


def test_a_claim_model_is_mounted_read_only_where_the_installation_allows_claims():
    pvc = job("Single", "pvc://models/llama/v2")
    [spec] = pod_specs(children(pvc, "uid", "tok"))
    assert {"name": "pretrained", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec["volumes"]
    trainer = spec["containers"][0]
    assert {"name": "pretrained", "mountPath": "/kubetrain/pretrained", "readOnly": True} in trainer["volumeMounts"]
    assert env_of(trainer)["KUBETRAIN_MODEL_DIR"] == "/kubetrain/pretrained/llama/v2"
    assert spec["initContainers"][0]["volumeMounts"][-1]["readOnly"] is True, "a claim is checked, never written"
    secrets = Settings(object_store_secrets=frozenset({"s3-creds"}))
    [refused] = podsecurity.problems(pvc, secrets)
    assert refused.startswith("spec.model.pretrained: a pvc:// pretrained model mounts a claim of the namespace")
    allowed = Settings(object_store_secrets=frozenset({"s3-creds"}), pod_security_allow=frozenset({"claims"}))
    assert podsecurity.problems(pvc, allowed) == []


def test_a_template_s_init_containers_come_after_kubetrain_s_and_may_not_take_its_name():
    template = {"spec": {"initContainers": [{"name": "warm-cache", "image": "busybox"}]}}
    [spec] = pod_specs(children(job("Single", "s3://models/base/", podTemplate=template), "uid", "tok"))
    assert [c["name"] for c in spec["initContainers"]] == ["model-init", "warm-cache"]
    clash = {"spec": {"initContainers": [{"name": "model-init", "image": "x"}], "volumes": [
        {"name": "model", "emptyDir": {}}]}}
    problems = dict(pod_template_problems(clash))
    assert problems["podTemplate.spec.initContainers[0].name"].startswith("'model-init' is the name of kubetrain")
    assert "podTemplate.spec.volumes[0].name" in problems


def test_a_lighthouse_gets_no_model():
    ft = job("DDP", "s3://models/base/", ddp={"nodes": 2, "faultTolerance": {}})
    lighthouse = next(o for o in children(ft, "uid", "tok") if o["kind"] == "Pod")
    assert "initContainers" not in lighthouse["spec"]
    assert not any(v["name"] == "model" for v in lighthouse["spec"]["volumes"])
