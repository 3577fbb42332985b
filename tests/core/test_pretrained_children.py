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


def job(mode: str, pretrained: str, model: dict | None = None, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"},
                        "spec": {"mode": mode, "dataset": TEXT, **spec,
                                 "model": {"name": "causal-lm", "pretrained": pretrained,
                                           **({"secretRef": "s3-creds"} if pretrained.startswith("s3://") else {}),
                                           **(model or {})}}})


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
        assert {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]
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


def test_model_init_takes_the_trainers_resources_as_the_template_merges_them():
    """Copied before the template was merged, model-init had no resources when the trainer's came from the
    template: the download of a many-gigabyte model ran unbounded, and a quota counting limits refused the pod."""
    limits = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1}
    template = {"spec": {"containers": [{"name": "trainer", "resources": {"limits": limits}}]}}
    for mode, extra in (("Single", {}), ("DDP", {"ddp": {"nodes": 2, "faultTolerance": {}}})):
        for pretrained in ("s3://models/base/", "pvc://models/base"):
            spec = pod_specs(children(job(mode, pretrained, podTemplate=template, **extra), "uid", "tok"))[-1]
            trainer, [init] = spec["containers"][0], spec["initContainers"]  # the StatefulSet's, not the Lighthouse
            assert init["resources"] == trainer["resources"], (mode, pretrained)
            assert {k: v for k, v in init["resources"]["limits"].items() if k != "ephemeral-storage"} == limits
    # spec.resources.worker as before; no resources at all, none either.
    [spec] = pod_specs(children(job("Single", "pvc://models/base", resources={"worker": {"requests": {"cpu": 1}}}),
                                "uid", "tok"))
    assert spec["initContainers"][0]["resources"] == {"requests": {"cpu": 1}}
    [spec] = pod_specs(children(job("Single", "pvc://models/base"), "uid", "tok"))
    assert "resources" not in spec["initContainers"][0] and "resources" not in spec["containers"][0]


def test_the_models_copy_is_bounded_by_disk_size_and_asked_for_as_ephemeral_storage():
    """An s3:// or hf:// model lands on the node's disk: its volume is bounded to spec.model.diskSize and the pod
    requests that much ephemeral-storage beside the trainer's own (added to a limit the trainer has), so the
    scheduler places it where the disk is; the initializer gets the bound in bytes, to refuse a larger model
    before the download. A claim's model is read where it lies: no copy, no bound."""
    def pod_of(pretrained: str, **spec) -> dict:
        [pod_spec] = pod_specs(children(job("Single", pretrained, **spec), "uid", "tok"))
        return pod_spec

    spec = pod_of("s3://models/base/", model={"diskSize": "40Gi"})
    assert {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}} in spec["volumes"]
    trainer, [init] = spec["containers"][0], spec["initContainers"]
    assert trainer["resources"] == init["resources"] == {"requests": {"ephemeral-storage": "40Gi"}}
    for container in (trainer, init):
        assert env_of(container)["KUBETRAIN_MODEL_MAX_BYTES"] == str(40 * 2**30)
    # Beside the trainer's own disk, from spec.resources or the template: its request (or its limit, which the API
    # server makes the request) and its limit grow by the model's size.
    own = {"spec": {"containers": [{"name": "trainer", "resources": {
        "requests": {"ephemeral-storage": "1Gi"}, "limits": {"ephemeral-storage": "2Gi", "memory": "1Gi"}}}]}}
    spec = pod_of("s3://models/base/", podTemplate=own)
    assert spec["containers"][0]["resources"] == {"requests": {"ephemeral-storage": "21Gi"},
                                                  "limits": {"ephemeral-storage": "22Gi", "memory": "1Gi"}}
    spec = pod_of("s3://models/base/", resources={"worker": {"limits": {"ephemeral-storage": "500Mi"}}})
    assert spec["containers"][0]["resources"] == {"requests": {"ephemeral-storage": "20980Mi"},
                                                  "limits": {"ephemeral-storage": "20980Mi"}}
    spec = pod_of("pvc://models/base")
    assert not any("emptyDir" in v and v["name"] == "model" for v in spec["volumes"])
    assert "resources" not in spec["containers"][0] and "KUBETRAIN_MODEL_MAX_BYTES" not in env_of(spec["containers"][0])


def test_a_template_container_may_not_take_model_inits_name_in_any_list():
    """Container names are unique across a pod's containers and init containers: a template's container named
    model-init (refused once only among initContainers) rendered a pod the API server refused, as would an init
    container named trainer."""
    problems = dict(pod_template_problems({"spec": {"containers": [{"name": "side"}, {"name": "model-init"}],
                                                    "initContainers": [{"name": "trainer", "image": "x"}]}}))
    assert problems == {
        "podTemplate.spec.containers[1].name":
            "'model-init' is the name of kubetrain's own init container (spec.model.pretrained)",
        "podTemplate.spec.initContainers[0].name":
            "'trainer' is the name of kubetrain's trainer container: an init container of that name would be a "
            "second container of one name in the pod, which the API server refuses",
    }


def test_a_lighthouse_gets_no_model():
    ft = job("DDP", "s3://models/base/", ddp={"nodes": 2, "faultTolerance": {}})
    lighthouse = next(o for o in children(ft, "uid", "tok") if o["kind"] == "Pod")
    assert "initContainers" not in lighthouse["spec"]
    assert not any(v["name"] == "model" for v in lighthouse["spec"]["volumes"])
