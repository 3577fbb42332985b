"""The objects a job owns in a cluster, and the plan they share with the local backend."""

from pathlib import Path

import pytest

from kubetrain_operator.api import from_object, load_one
from kubetrain_operator.core.children import ClusterEndpoints, children, merge_pod_template
from kubetrain_operator.core.plan import plan_replicas
from kubetrain_operator.local.backend import local_endpoints
from kubetrain_operator.local.rundir import RunDir

EXAMPLES = Path(__file__).parents[2] / "examples"


def job(mode, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"}, "spec": {"mode": mode, **spec}})


def kinds(objs):
    return [(o["kind"], o["metadata"]["name"]) for o in objs]


def test_parameter_server_children():
    objs = children(job("ParameterServer", parameterServer={"replicas": 2, "workers": 3}), "uid-1", "tok")
    assert kinds(objs) == [
        ("ConfigMap", "j-config"), ("Secret", "j-token"),
        ("Service", "j-ps-0"), ("Service", "j-ps-1"),
        ("PersistentVolumeClaim", "j-ckpt-ps-0"), ("PersistentVolumeClaim", "j-ckpt-ps-1"),
        ("Pod", "j-ps-0"), ("Pod", "j-ps-1"), ("Pod", "j-worker-0"), ("Pod", "j-worker-1"), ("Pod", "j-worker-2"),
    ]
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("TrainingJob", "j", "uid-1", True)
        assert o["metadata"]["namespace"] == "ns"
    worker = objs[-1]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["KUBETRAIN_PS_ADDRS"] == "j-ps-0:50051,j-ps-1:50051"
    assert env["KUBETRAIN_REPLICA"] == "worker-2"
    token = next(e for e in worker["env"] if e["name"] == "KUBETRAIN_JOB_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "j-token", "key": "token"}
    assert worker["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The trainer writes its final results where the kubelet reads the termination message.
    assert env["KUBETRAIN_TERMINATION_LOG"] == worker["terminationMessagePath"] == "/dev/termination-log"
    assert worker["securityContext"]["runAsNonRoot"] is True
    assert objs[-1]["spec"]["securityContext"]["runAsUser"] == 1000
    # Workers keep nothing; shards keep their checkpoints on their own ReadWriteOnce volume.
    assert objs[-1]["spec"]["volumes"][1] == {"name": "data", "emptyDir": {}}
    assert objs[6]["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"] == "j-ckpt-ps-0"
    assert objs[4]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_ddp_is_a_statefulset_with_a_headless_service():
    objs = children(job("DDP", ddp={"nodes": 3, "procsPerNode": 2}), "u", "t")
    assert kinds(objs) == [("ConfigMap", "j-config"), ("Secret", "j-token"), ("Service", "j-ddp"), ("StatefulSet", "j-ddp")]
    sts = objs[-1]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "j-ddp"
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    # One template: the agent learns whether it hosts the rendezvous from its ordinal.
    assert "--rdzv-conf" not in command
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "pod-index" in env["KUBETRAIN_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert command[command.index("--rdzv-endpoint") + 1] == "j-ddp-0.j-ddp:29400"
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[command.index("--nnodes") + 1] == "3"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


def test_single_uses_existing_claim():
    objs = children(job("Single", checkpoint={"storage": {"existingClaim": "mine"}}), "u", "t")
    assert "PersistentVolumeClaim" not in [o["kind"] for o in objs]
    assert objs[-1]["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"] == "mine"


def test_image_and_resources_and_pod_template():
    j = job("Single", image="me/trainer:1", resources={"worker": {"limits": {"cpu": "2"}}},
            podTemplate={"metadata": {"labels": {"team": "a"}},
                         "spec": {"nodeSelector": {"gpu": "yes"},
                                  "containers": [{"name": "trainer", "env": [{"name": "X", "value": "1"}]}]}})
    pod = children(j, "u", "t")[-1]
    c = pod["spec"]["containers"][0]
    assert c["image"] == "me/trainer:1"
    assert c["resources"] == {"limits": {"cpu": "2"}}
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["spec"]["nodeSelector"] == {"gpu": "yes"}
    assert {"name": "X", "value": "1"} in c["env"]


def test_pod_template_env_overrides_by_name():
    pod = {"metadata": {}, "spec": {"containers": [{"name": "trainer", "env": [{"name": "A", "value": "1"}]}]}}
    merged = merge_pod_template(pod, {"spec": {"containers": [{"name": "trainer", "env": [{"name": "A", "value": "2"}]}]}})
    assert merged["spec"]["containers"][0]["env"] == [{"name": "A", "value": "2"}]
    assert pod["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]


def _normalised(replicas):
    """Addresses and paths differ by design between backends; everything else must not."""
    out = []
    for r in replicas:
        env = dict(r.env)
        for key in ("KUBETRAIN_PS_ADDRS", "KUBETRAIN_PS_PORT", "KUBETRAIN_JOB_FILE", "KUBETRAIN_RUN_DIR",
                    "KUBETRAIN_CHECKPOINT_DIR", "KUBETRAIN_METRICS_PORT"):
            if key in env:
                env[key] = "<endpoint>"
        command = list(r.command)
        if "--local-addr" in command:  # loopback locally, the pod's own address in a cluster
            i = command.index("--local-addr")
            del command[i : i + 2]
        if "--rdzv-endpoint" in command:
            command[command.index("--rdzv-endpoint") + 1] = "<endpoint>"
        command = tuple(command)
        out.append((r.name, command, env, sorted(r.ports)))
    return out


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_local_backend_and_operator_plan_the_same_replicas(example, tmp_path):
    j = load_one(example)
    local = plan_replicas(j, local_endpoints(j, RunDir(tmp_path)))
    cluster = plan_replicas(j, ClusterEndpoints(j))
    assert _normalised(local) == _normalised(cluster)
    assert [r.name for r in local]
