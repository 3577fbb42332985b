"""The objects a job owns in a cluster, and the plan they share with the local backend."""

from pathlib import Path

import pytest

from kubetrain.api import from_object, load_one, podtemplate
from kubetrain.engine.children import ClusterEndpoints, Settings, children, merge_pod_template
from kubetrain.engine.plan import plan_replicas
from kubetrain.drivers.local.runner import local_endpoints
from kubetrain.drivers.local.rundir import RunDir

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
    # Each shard's Service has a virtual address (not headless): the name outlives the pod's address.
    for service in (o for o in objs if o["kind"] == "Service"):
        assert "clusterIP" not in service["spec"] and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"]["kubetrain.dev/replica"] == service["metadata"]["name"][len("j-"):]
        assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == \
            [("grpc", 50051, 50051), ("ps-data", 50052, 50052), ("metrics", 9090, 9090)]
    worker = objs[-1]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["KUBETRAIN_PS_ADDRS"] == "j-ps-0:50051,j-ps-1:50051"
    # Pull and Push go to each shard's data plane, through the same Service.
    assert env["KUBETRAIN_PS_DATA_ADDRS"] == "j-ps-0:50052,j-ps-1:50052"
    shard_env = {e["name"]: e.get("value") for e in objs[6]["spec"]["containers"][0]["env"]}
    assert (shard_env["KUBETRAIN_PS_PORT"], shard_env["KUBETRAIN_PS_DATA_PORT"]) == ("50051", "50052")
    assert {(p["name"], p["containerPort"]) for p in objs[6]["spec"]["containers"][0]["ports"]} >= \
        {("grpc", 50051), ("ps-data", 50052)}
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


def test_a_ddp_job_on_read_write_many_gets_one_claim_that_every_node_mounts():
    # Sharded checkpoints: every rank writes its shards, every rank reads them all.
    objs = children(job("DDP", ddp={"nodes": 3, "strategy": "FSDP"},
                        checkpoint={"storage": {"accessMode": "ReadWriteMany", "size": "5Gi"}}), "u", "t")
    claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["name"] for c in claims] == ["j-ckpt-ddp"]
    assert claims[0]["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "5Gi"}}}
    assert claims[0]["metadata"]["ownerReferences"][0]["uid"] == "u"  # whenDeleted Delete: the job's
    sts = objs[-1]
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "j-ckpt-ddp"}}
    assert checkpoint_dirs(objs) == {"j-ddp": ("/kubetrain/data/checkpoints", "/kubetrain/data/run")}
    # Created before the StatefulSet that mounts it.
    assert kinds(objs).index(("PersistentVolumeClaim", "j-ckpt-ddp")) < kinds(objs).index(("StatefulSet", "j-ddp"))


def test_locally_the_nodes_of_a_read_write_many_job_share_node_0s_directory(tmp_path):
    rwx = job("DDP", ddp={"nodes": 2}, checkpoint={"storage": {"accessMode": "ReadWriteMany"}})
    rwo = job("DDP", ddp={"nodes": 2})
    for j, expected in ((rwx, ["ddp-0", "ddp-0"]), (rwo, ["ddp-0", "ddp-1"])):
        replicas = plan_replicas(j, local_endpoints(j, RunDir(tmp_path / j.spec.checkpoint.storage.access_mode)))
        assert [Path(r.env["KUBETRAIN_CHECKPOINT_DIR"]).name for r in replicas] == expected


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
        for key in ("KUBETRAIN_PS_ADDRS", "KUBETRAIN_PS_PORT", "KUBETRAIN_PS_DATA_ADDRS", "KUBETRAIN_PS_DATA_PORT",
                    "KUBETRAIN_JOB_FILE", "KUBETRAIN_RUN_DIR", "KUBETRAIN_CHECKPOINT_DIR", "KUBETRAIN_METRICS_PORT",
                    "KUBETRAIN_LISTEN_ADDRESS", "KUBETRAIN_FT_LIGHTHOUSE", "KUBETRAIN_FT_STORE",
                    "KUBETRAIN_FT_LIGHTHOUSE_PORT"):
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


# --- spec.podTemplate: lists merge with kubetrain's by name ---------------------------

DATASET_TEMPLATE = {
    "spec": {
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["sh", "-c", "cp -r /src/. /dataset"],
                            "volumeMounts": [{"name": "dataset", "mountPath": "/dataset"}]}],
        "volumes": [{"name": "dataset", "emptyDir": {}}],
        "containers": [{"name": "trainer",
                        "env": [{"name": "DATASET_DIR", "value": "/dataset"}],
                        "ports": [{"name": "profiler", "containerPort": 6006}],
                        "volumeMounts": [{"name": "dataset", "mountPath": "/dataset", "readOnly": True}]}],
    }
}


def pod_spec_of(obj):
    """The pod spec of a Pod, or of a StatefulSet's pod template."""
    return obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"]


def trainer_of(obj):
    return next(c for c in pod_spec_of(obj)["containers"] if c["name"] == "trainer")


@pytest.mark.parametrize("mode, storage", [("Single", {}), ("DDP", {}), ("DDP", {"existingClaim": "shared", "accessMode": "ReadWriteMany"})],
                         ids=["pod", "statefulset", "statefulset-existing-claim"])
def test_pod_template_lists_merge_with_kubetrains_by_name(mode, storage):
    plain = children(job(mode, checkpoint={"storage": storage}), "u", "t")[-1]
    merged = children(job(mode, checkpoint={"storage": storage}, podTemplate=DATASET_TEMPLATE), "u", "t")[-1]
    spec, trainer, before = pod_spec_of(merged), trainer_of(merged), trainer_of(plain)
    # kubetrain's own items stay, in their order; the template's are appended.
    assert spec["volumes"] == pod_spec_of(plain)["volumes"] + [{"name": "dataset", "emptyDir": {}}]
    assert trainer["volumeMounts"] == before["volumeMounts"] + [{"name": "dataset", "mountPath": "/dataset", "readOnly": True}]
    assert trainer["env"] == before["env"] + [{"name": "DATASET_DIR", "value": "/dataset"}]
    assert trainer["ports"] == before["ports"] + [{"name": "profiler", "containerPort": 6006}]
    # The init container that fills the user's volume comes whole, with kubetrain's security fields.
    assert spec["initContainers"] == [hardened(c) for c in DATASET_TEMPLATE["spec"]["initContainers"]]
    assert [c["name"] for c in spec["containers"]] == ["trainer"]


def test_the_checkpoint_volume_survives_a_template_volume():
    for mode, storage, source in [
        ("Single", {}, {"persistentVolumeClaim": {"claimName": "j-ckpt-single-0"}}),
        ("Single", {"existingClaim": "mine"}, {"persistentVolumeClaim": {"claimName": "mine"}}),
        ("DDP", {"existingClaim": "shared", "accessMode": "ReadWriteMany"}, {"persistentVolumeClaim": {"claimName": "shared"}}),
    ]:
        obj = children(job(mode, checkpoint={"storage": storage}, podTemplate=DATASET_TEMPLATE), "u", "t")[-1]
        volumes = {v["name"]: v for v in pod_spec_of(obj)["volumes"]}
        assert volumes["data"] == {"name": "data", **source}, mode
        assert {"config", "tmp", "dataset"} <= set(volumes)
        mounts = {m["mountPath"]: m["name"] for m in trainer_of(obj)["volumeMounts"]}
        assert mounts == {"/etc/kubetrain": "config", "/kubetrain/data": "data", "/tmp": "tmp", "/dataset": "dataset"}
    # DDP without existingClaim: the claim template provides `data`, the pod spec does not name it twice.
    sts = children(job("DDP", podTemplate=DATASET_TEMPLATE), "u", "t")[-1]
    assert [v["name"] for v in pod_spec_of(sts)["volumes"]] == ["config", "tmp", "dataset"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_a_sidecar_is_appended_and_may_mount_kubetrains_volumes():
    template = {"spec": {"containers": [{"name": "uploader", "image": "me/up:1",
                                         "env": [{"name": "HOME", "value": "/home/up"}],
                                         "volumeMounts": [{"name": "data", "mountPath": "/ckpt", "readOnly": True}]}]}}
    j = job("Single", podTemplate=template)  # valid: only the trainer's names are kubetrain's
    spec = children(j, "u", "t")[-1]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "uploader"]
    assert spec["containers"][1] == hardened(template["spec"]["containers"][0])


def hardened(container: dict) -> dict:
    """A template's container as the pod holds it: kubetrain's own security fields applied after it."""
    return {**container, "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def test_one_volume_mounted_at_two_paths_keeps_both_mounts():
    # volumeMounts merge by mountPath (as Kubernetes' strategic merge patch does):
    # two subPath mounts of one volume are two mounts.
    template = {"spec": {"volumes": [{"name": "shared", "emptyDir": {}}],
                         "containers": [{"name": "trainer", "volumeMounts": [
                             {"name": "shared", "mountPath": "/in", "subPath": "in"},
                             {"name": "shared", "mountPath": "/out", "subPath": "out"}]}]}}
    mounts = children(job("Single", podTemplate=template), "u", "t")[-1]["spec"]["containers"][0]["volumeMounts"]
    assert [m["mountPath"] for m in mounts] == ["/etc/kubetrain", "/kubetrain/data", "/tmp", "/in", "/out"]


@pytest.mark.parametrize("key, base_item, over_item", [
    ("volumes", {"name": "v", "emptyDir": {}}, {"name": "v", "hostPath": {"path": "/x"}}),
    ("env", {"name": "A", "value": "1"}, {"name": "A", "value": "2"}),
    ("ports", {"name": "p", "containerPort": 1}, {"name": "p", "containerPort": 2}),
    ("volumeMounts", {"name": "v", "mountPath": "/m"}, {"name": "w", "mountPath": "/m"}),
])
def test_a_template_item_with_the_key_of_an_existing_item_replaces_it(key, base_item, over_item):
    # Unvalidated input only: the validator refuses kubetrain's own names.
    where = "spec" if key == "volumes" else "container"
    pod = {"metadata": {}, "spec": {"containers": [{"name": "trainer"}]}}
    target = pod["spec"] if where == "spec" else pod["spec"]["containers"][0]
    target[key] = [{"name": "keep", "mountPath": "/keep"} if key == "volumeMounts" else {"name": "keep"}, base_item]
    over = {key: [over_item, {"name": "new", "mountPath": "/new"}]}
    merged = merge_pod_template(pod, {"spec": over if where == "spec" else {"containers": [{"name": "trainer", **over}]}})
    got = merged["spec"][key] if where == "spec" else merged["spec"]["containers"][0][key]
    assert got == [target[key][0], over_item, {"name": "new", "mountPath": "/new"}]


def test_other_pod_template_lists_are_replaced_whole():
    base = {"metadata": {}, "spec": {"containers": [{"name": "trainer"}], "tolerations": [{"key": "a"}]}}
    merged = merge_pod_template(base, {"spec": {"tolerations": [{"key": "b"}]}})
    assert merged["spec"]["tolerations"] == [{"key": "b"}]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_name_kubetrain_gives_a_pod_is_reserved(example):
    """The plan's variables and ports (engine/plan.py) must stay within what api/podtemplate.py refuses."""
    j = load_one(example)
    pods = [o for o in children(j, "u", "t") if o["kind"] in ("Pod", "StatefulSet")]
    assert pods
    for obj in pods:
        spec, trainer = pod_spec_of(obj), trainer_of(obj)
        assert {v["name"] for v in spec["volumes"]} <= set(podtemplate.VOLUMES)
        for m in trainer["volumeMounts"]:
            assert podtemplate.MOUNTS[m["mountPath"]] == m["name"]
        for e in trainer["env"]:
            assert podtemplate.reserved_env(e["name"]), f"{e['name']} is set by kubetrain but not reserved"
        for p in trainer.get("ports", []):
            assert p["name"] in podtemplate.PORTS, f"port {p['name']} is kubetrain's but not reserved"


# --- checkpoint.storage.whenDeleted ----------------------------------------------------

@pytest.mark.parametrize("mode, spec", [("Single", {}), ("ParameterServer", {"parameterServer": {"replicas": 2}})])
def test_retained_claims_have_no_owner_and_keep_their_labels(mode, spec):
    retained = [o for o in children(job(mode, checkpoint={"storage": {"whenDeleted": "Retain"}}, **spec), "u", "t")
                if o["kind"] == "PersistentVolumeClaim"]
    assert retained
    for claim in retained:
        assert "ownerReferences" not in claim["metadata"]
        labels = claim["metadata"]["labels"]
        assert labels["kubetrain.dev/job-name"] == "j" and labels["app.kubernetes.io/managed-by"] == "kubetrain"
        assert labels["kubetrain.dev/replica"] == claim["metadata"]["name"].removeprefix("j-ckpt-")
    # Everything else is still owned: only the checkpoints outlive the job.
    others = [o for o in children(job(mode, checkpoint={"storage": {"whenDeleted": "Retain"}}, **spec), "u", "t")
              if o["kind"] != "PersistentVolumeClaim"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u" for o in others)


def test_claims_are_deleted_with_the_job_by_default():
    claims = [o for o in children(job("Single"), "u", "t") if o["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["ownerReferences"][0]["uid"] for c in claims] == ["u"]


@pytest.mark.parametrize("when", ["Delete", "Retain"])
def test_ddp_claim_retention_follows_when_deleted(when):
    sts = children(job("DDP", checkpoint={"storage": {"whenDeleted": when}}), "u", "t")[-1]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": when, "whenScaled": "Retain"}
    assert sts["metadata"]["ownerReferences"][0]["uid"] == "u"


# --- Pod Security `restricted`, and no ServiceAccount token ------------------------------

RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}


def restricted_violations(spec: dict) -> list[str]:
    """What Pod Security `restricted` (v1.36) refuses in a pod spec, for the fields kubetrain sets."""
    out = []
    pod_ctx = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for volume in spec.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES:
            out.append(f"volume {volume['name']}: {sorted(set(volume) - {'name'})}")
    if pod_ctx.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        ctx = c.get("securityContext", {})
        if ctx.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{c['name']}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: adds capabilities")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot must be true")
        if ctx.get("runAsUser") == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile must be RuntimeDefault or Localhost")
    return out


@pytest.mark.parametrize("mode, spec", [
    ("Single", {}),
    ("ParameterServer", {"parameterServer": {"replicas": 2, "workers": 2}}),
    ("DDP", {"ddp": {"nodes": 2}}),
    ("ParameterServer", {"checkpoint": {"storage": {"existingClaim": "shared"}}}),
], ids=["single", "ps", "ddp-statefulset", "ps-existing-claim"])
def test_trainer_pods_meet_pod_security_restricted_without_a_service_account_token(mode, spec):
    pods = [o for o in children(job(mode, **spec), "u", "t") if o["kind"] in ("Pod", "StatefulSet")]
    assert pods
    for obj in pods:
        pod_spec = pod_spec_of(obj)
        assert restricted_violations(pod_spec) == [], obj["metadata"]["name"]
        assert pod_spec["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod_spec  # the namespace's default, and no token of it
        assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_a_restricted_sidecar_in_the_template_keeps_the_pod_restricted():
    # The pod-level runAsNonRoot and seccompProfile cover a template's containers.
    sidecar = {"name": "upload", "image": "busybox",
               "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    pod = children(job("Single", podTemplate={"spec": {"containers": [sidecar]}}), "u", "t")[-1]
    assert restricted_violations(pod["spec"]) == []


def test_the_restricted_check_of_these_tests_sees_what_a_template_could_undo():
    over = {"spec": {"hostPID": True, "containers": [{"name": "trainer", "securityContext": {"privileged": True}}],
                     "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}
    # children() renders what it is given: the refusal is validate's, the policy's and the operator's
    # (api/podtemplate.pod_security_problems, tests/api/test_pod_security.py).
    pod = children(job("Single", podTemplate=over), "u", "t")[-1]
    assert restricted_violations(pod["spec"]) == ["hostPID", "volume root: ['hostPath']", "trainer: privileged"]


# --- checkpoint.storage.existingClaim: a directory per replica ---------------------------

def checkpoint_dirs(objs) -> dict[str, str]:
    """Pod (or StatefulSet) name -> the trainer's KUBETRAIN_CHECKPOINT_DIR and KUBETRAIN_RUN_DIR."""
    out = {}
    for obj in objs:
        if obj["kind"] in ("Pod", "StatefulSet"):
            env = {e["name"]: e.get("value") for e in trainer_of(obj)["env"]}
            out[obj["metadata"]["name"]] = (env["KUBETRAIN_CHECKPOINT_DIR"], env["KUBETRAIN_RUN_DIR"])
    return out


def test_replicas_sharing_an_existing_claim_each_get_their_own_checkpoint_directory():
    shared = {"storage": {"existingClaim": "shared", "accessMode": "ReadWriteMany"}}
    dirs = checkpoint_dirs(children(job("ParameterServer", parameterServer={"replicas": 2, "workers": 1},
                                        checkpoint=shared), "u", "t"))
    # ps-0 and ps-1 write the same step names: one directory made ps-0 resume from ps-1's shard.
    assert dirs["j-ps-0"] == ("/kubetrain/data/j/checkpoints/ps-0", "/kubetrain/data/j")
    assert dirs["j-ps-1"] == ("/kubetrain/data/j/checkpoints/ps-1", "/kubetrain/data/j")
    assert dirs["j-worker-0"][0] == "/kubetrain/data/j/checkpoints/worker-0"  # on its emptyDir
    assert checkpoint_dirs(children(job("Single", checkpoint=shared), "u", "t")) == {
        "j-single-0": ("/kubetrain/data/j/checkpoints/single-0", "/kubetrain/data/j")}
    # Another job on the same claim has a directory of its own.
    other = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                         "metadata": {"name": "k", "namespace": "ns"}, "spec": {"mode": "Single", "checkpoint": shared}})
    assert checkpoint_dirs(children(other, "u", "t"))["k-single-0"][0] == "/kubetrain/data/k/checkpoints/single-0"


def test_ddp_nodes_sharing_an_existing_claim_share_rank_0s_directory():
    # One template for every node; the group agrees on the newest checkpoint and rank 0 writes it.
    shared = {"storage": {"existingClaim": "shared", "accessMode": "ReadWriteMany"}}
    assert checkpoint_dirs(children(job("DDP", ddp={"nodes": 2}, checkpoint=shared), "u", "t")) == {
        "j-ddp": ("/kubetrain/data/j/checkpoints/ddp-0", "/kubetrain/data/j")}


@pytest.mark.parametrize("mode", ["Single", "ParameterServer", "DDP"])
def test_a_claim_of_its_own_keeps_the_checkpoints_at_its_top(mode):
    # The layout retained claims hold (docs/operating.md): checkpoints/ and run/.
    for ckpt, run in checkpoint_dirs(children(job(mode), "u", "t")).values():
        assert (ckpt, run) == ("/kubetrain/data/checkpoints", "/kubetrain/data/run")


# Per-job network isolation (the NetworkPolicy, with the operator's --metrics-from-json).
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubetrain"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ISOLATED = Settings(network_policy=True, metrics_from=(OPERATOR_PEER, PROMETHEUS_PEER))


def policy_of(objs):
    [policy] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return policy


def pod_labels(obj):
    return (obj["spec"]["template"] if obj["kind"] == "StatefulSet" else obj)["metadata"]["labels"]


def admits(policy, labels, namespace, port, peer_namespace_labels=None):
    """Whether `policy` lets a pod (its labels, its namespace) connect to `port` over TCP: the
    NetworkPolicy rules for matchLabels peers, as an enforcing network plugin applies them."""
    def matches(selector, have):
        return all(have.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    def peer_matches(peer):
        if "namespaceSelector" in peer:
            ns_labels = {"kubernetes.io/metadata.name": namespace, **(peer_namespace_labels or {})}
            if not matches(peer["namespaceSelector"], ns_labels):
                return False
        elif namespace != policy["metadata"]["namespace"]:
            return False  # a podSelector alone: pods of the policy's namespace
        return matches(peer.get("podSelector", {}), labels)

    def port_matches(rule):
        return any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in rule.get("ports", [{}]))

    return any(port_matches(rule) and any(peer_matches(p) for p in rule["from"]) for rule in policy["spec"]["ingress"])


@pytest.mark.parametrize("mode, spec", [
    ("Single", {}),
    ("ParameterServer", {"parameterServer": {"replicas": 2, "workers": 2}}),
    ("DDP", {"ddp": {"nodes": 2}}),
], ids=["single", "ps", "ddp"])
def test_every_job_gets_a_network_policy_over_all_its_pods_before_any_pod(mode, spec):
    objs = children(job(mode, **spec), "uid-1", "t", ISOLATED)
    order = [o["kind"] for o in objs]
    policy = policy_of(objs)
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert kinds([policy]) == [("NetworkPolicy", "j-isolation")]
    assert order.index("NetworkPolicy") < min(i for i, k in enumerate(order) if k in ("Pod", "StatefulSet"))
    ref = policy["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("TrainingJob", "j", "uid-1", True)
    assert policy["metadata"]["namespace"] == "ns"
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # what trainers connect to stays open
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for obj in objs:
        if obj["kind"] in ("Pod", "StatefulSet"):
            assert selector.items() <= pod_labels(obj).items(), obj["metadata"]["name"]


def test_without_the_setting_a_job_gets_no_network_policy():
    assert "NetworkPolicy" not in [o["kind"] for o in children(job("Single"), "u", "t")]
    assert "NetworkPolicy" not in [o["kind"] for o in children(job("Single"), "u", "t", Settings(metrics_from=(OPERATOR_PEER,)))]


JOB_POD = {"kubetrain.dev/job-name": "j", "kubetrain.dev/role": "worker"}
OTHER_JOB = {"kubetrain.dev/job-name": "k", "kubetrain.dev/role": "worker"}
OPERATOR = {"app.kubernetes.io/component": "operator"}


@pytest.mark.parametrize("name, labels, namespace, port, admitted", [
    ("a pod of the job, parameter server", JOB_POD, "ns", 50051, True),
    ("a pod of the job, rendezvous", JOB_POD, "ns", 29400, True),
    ("a pod of the job, gloo's ephemeral port", JOB_POD, "ns", 41234, True),
    ("a pod of the job, metrics", JOB_POD, "ns", 9090, True),
    ("another job's pod, parameter server", OTHER_JOB, "ns", 50051, False),
    ("another job's pod, rendezvous", OTHER_JOB, "ns", 29400, False),
    ("another job's pod, metrics", OTHER_JOB, "ns", 9090, False),
    ("the job's label in another namespace", JOB_POD, "elsewhere", 50051, False),
    ("the operator, metrics", OPERATOR, "kubetrain", 9090, True),
    ("the operator, parameter server", OPERATOR, "kubetrain", 50051, False),
    ("the operator's labels in another namespace, metrics", OPERATOR, "ns", 9090, False),
    ("any pod of the monitoring namespace, metrics", {}, "monitoring", 9090, True),
    ("any pod of the monitoring namespace, rendezvous", {}, "monitoring", 29400, False),
])
def test_the_policy_admits_the_job_to_itself_and_the_listed_peers_to_metrics_only(name, labels, namespace, port, admitted):
    policy = policy_of(children(job("ParameterServer"), "u", "t", ISOLATED))
    assert admits(policy, labels, namespace, port) is admitted, name


def test_the_metrics_rule_follows_spec_metrics_port():
    policy = policy_of(children(job("Single", metrics={"port": 9191}), "u", "t", ISOLATED))
    assert policy["spec"]["ingress"][1] == {"from": [OPERATOR_PEER, PROMETHEUS_PEER], "ports": [{"protocol": "TCP", "port": 9191}]}
    assert not admits(policy, OPERATOR, "kubetrain", 9090)


@pytest.mark.parametrize("metrics, peers", [({"port": 0}, (OPERATOR_PEER,)), ({"port": 9090}, ())], ids=["metrics-off", "no-peers"])
def test_no_metrics_rule_without_a_metrics_port_or_a_peer(metrics, peers):
    # A rule without `from` would admit every source: never render one.
    policy = policy_of(children(job("Single", metrics=metrics), "u", "t", Settings(network_policy=True, metrics_from=peers)))
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"kubetrain.dev/job-name": "j"}}}],
                                          "ports": [{"protocol": "TCP"}]}]
    assert not admits(policy, OPERATOR, "kubetrain", 9090)


def test_the_policy_copies_the_peers_it_is_given():
    policy = policy_of(children(job("Single"), "u", "t", ISOLATED))
    policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]["x"] = "y"
    assert "x" not in OPERATOR_PEER["podSelector"]["matchLabels"]


# --- kubetrain's own labels after the template's (issue 31) -------------------------------------

@pytest.mark.parametrize("mode", ["Single", "DDP"])
def test_kubetrains_own_labels_come_after_the_templates(mode):
    """A template that named another job (the validator and the CRD refuse it: tests/api/test_validate.py)
    still renders pods that are this job's: the operator, the Services and the NetworkPolicy select by them."""
    j = job(mode)
    j.spec.pod_template = {"metadata": {
        "labels": {"kubetrain.dev/job-name": "victim", "kubetrain.dev/replica": "single-0", "kubetrain.dev/role": "x",
                   "app.kubernetes.io/managed-by": "me", "team": "vision"},
        "annotations": {"prometheus.io/port": "1", "note": "mine"}}}
    obj = children(j, "u", "t")[-1]
    meta = obj["spec"]["template"]["metadata"] if mode == "DDP" else obj["metadata"]
    own = {"kubetrain.dev/job-name": "j", "app.kubernetes.io/managed-by": "kubetrain",
           "kubetrain.dev/role": "ddp" if mode == "DDP" else "single"}
    if mode == "Single":
        own["kubetrain.dev/replica"] = "single-0"
    assert meta["labels"] == {**own, "team": "vision"}
    # Other annotations are the template's to set, as before.
    assert meta["annotations"]["prometheus.io/port"] == "1" and meta["annotations"]["note"] == "mine"
