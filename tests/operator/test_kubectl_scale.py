"""Elastic jobs against the real API server and operator: `kubectl scale trainingjob` through the CRD's
scale subresource, the resize the operator carries out (a ParameterServer job live: the job file rendered
again, its shard annotated, new workers made, the workers above the size deleted once they ended; a DDP
job's old replicas all stopped, the job file and StatefulSet rendered again, the new set started), and
the sizes the API server refuses (kubetrain/api/crd.py SIZE_CEL).

The operator here runs as the chart's ServiceAccount with the chart's own (namespaced) Role, so a verb
a resize needs and the chart does not grant is refused here as in a real install. Pods run on kwok's
fake nodes, which delete a pod as soon as it is deleted gracefully: the old set is gone within a round
or two. A watch (`kubectl get -w`) records every version of the job and of the StatefulSet, so the
short-lived steps in between (status.replicas still at the old size while the job resizes, the
StatefulSet at 0) are seen however quickly they pass.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from helpers.process import stop_process
from helpers.recovery import json_stream
from support import ROOT
from test_lifecycle import condition, manifest, pods_of

pytestmark = pytest.mark.cluster

DDP_ELASTIC = {"nodes": 2, "minNodes": 1, "maxNodes": 2, "procsPerNode": 1, "backend": "gloo"}
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


@pytest.fixture
def operator(cluster, spawn_operator, tmp_path):
    """`kubetrain operator` as the chart renders it (namespaced): its arguments, its ServiceAccount and
    Role, and a kubeconfig holding that ServiceAccount's token; one per test, in place of the session's
    operator (which runs as the admin). The test itself acts as the admin."""
    namespace = f"sc-{uuid.uuid4().hex[:6]}"
    release = f"kubetrain-{namespace}"
    cluster.kubectl("create", "namespace", namespace)
    docs = [d for d in yaml.safe_load_all(cluster.run("helm", "template", release, str(ROOT / "charts" / "kubetrain"),
                                                      "--namespace", namespace, "--set", "operator.namespaced=true")) if d]
    rbac = [d for d in docs if d["kind"] in RBAC_KINDS]
    try:
        cluster.kube(namespace).apply(*rbac)
        token = cluster.kubectl("create", "token", release, "-n", namespace, "--duration=1h").strip()
        view = cluster.kube().json("config", "view", "--raw", "--minify")
        kubeconfig = tmp_path / "operator-kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "clusters": view["clusters"], "current-context": "operator",
            "contexts": [{"name": "operator", "context": {"cluster": view["clusters"][0]["name"], "user": "operator"}}],
            "users": [{"name": "operator", "user": {"token": token}}]}))
        who = cluster.kube().json("--kubeconfig", str(kubeconfig), "auth", "whoami")
        assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:{release}"
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
                if not a.startswith(("--namespace=", "--metrics-port=", "--liveness-port="))]  # spawn_operator's own
        yield spawn_operator(namespace, *args, env={"KUBECONFIG": str(kubeconfig)}).handle(cluster, namespace)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        for d in rbac:
            if d["kind"].startswith("Cluster"):
                cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")


WATCH_CATCH_UP_SECONDS = 30  # a watch's event trails the object's write by milliseconds; seconds under load


class Watch:
    """`kubectl get KIND NAME -w -o json`: every version of one object from now on, read at `stop()`."""

    def __init__(self, op, kind: str, name: str, out: Path):
        self._out = out.open("w")
        self._proc = subprocess.Popen(["kubectl", "-n", op.namespace, "get", kind, name, "-w", "-o", "json"],
                                      env=op.cluster.env, stdout=self._out, stderr=subprocess.DEVNULL)
        self._path = out
        self._op, self._what = op, f"{kind} {name}"
        # The first version printed is the object as it is now: the watch has begun once it is there.
        op.wait(f"the watch of {kind} {name}", lambda: json_stream(out.read_text())[0])

    def caught_up(self, check) -> None:
        """Waits until the newest version the watch printed passes `check`: a poll (`settled`) can see a
        change before the watch does, and a watch stopped then would miss it."""
        self._op.wait(f"the watch of {self._what} to see the change",
                      lambda: (seen := json_stream(self._path.read_text())[0]) and check(seen[-1]),
                      timeout=WATCH_CATCH_UP_SECONDS)

    def stop(self) -> list[dict]:
        stop_process(self._proc, timeout=10)
        self._out.close()
        return json_stream(self._path.read_text())[0]


def scale(op, name: str, replicas: int, check: bool = True) -> subprocess.CompletedProcess:
    return op.kube.run("scale", "trainingjob", name, f"--replicas={replicas}", check=check)


def scale_subresource(op, name: str) -> dict:
    """What an autoscaler reads: the job's Scale object."""
    return op.kube.json("get", "trainingjob", name, "--subresource=scale")


def job_file(op, name: str) -> dict:
    """The job.yaml every trainer of the job reads (its ConfigMap)."""
    return yaml.safe_load(op.get("configmap", f"{name}-config")["data"]["job.yaml"])


def running_set(op, name: str, replicas: set[str], old_uids: set[str] = frozenset()) -> dict[str, dict]:
    """Exactly these replicas' pods, each Running and none of them one of `old_uids`."""
    want = {f"{name}-{r}" for r in replicas}

    def check():
        pods = pods_of(op, name)
        return (set(pods) == want and all(p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
                                          and p["metadata"]["uid"] not in old_uids for p in pods.values()) and pods)

    return op.wait(f"pods {sorted(replicas)} of {name} running", check, timeout=90)


def running_at(status: dict, replicas: int) -> bool:
    return status.get("state") == "Running" and status.get("replicas") == replicas \
        and (condition(status, "Running") or {}).get("status") == "True"


def settled(op, name: str, replicas: int) -> dict:
    """The job Running at `replicas`, as its status says."""
    return op.wait(f"{name} Running at {replicas}", lambda: running_at(s := op.job_status(name), replicas) and s,
                   timeout=90)


def reasons(op, name: str) -> list[str]:
    """The job's Event reasons, oldest first (by resourceVersion: their times are whole seconds)."""
    events = sorted(op.events(name), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [e["reason"] for e in events]


def sizes(versions: list[dict]) -> list[tuple[int | None, str | None]]:
    """(status.replicas, the Restarting condition's reason when true) of each version, repeats folded."""
    out: list[tuple[int | None, str | None]] = []
    for job in versions:
        status = job.get("status") or {}
        restarting = condition(status, "Restarting") or {}
        seen = (status.get("replicas"), restarting.get("reason") if restarting.get("status") == "True" else None)
        if not out or out[-1] != seen:
            out.append(seen)
    return out


def resize(op, name: str, replicas: int, tmp_path: Path) -> list[tuple[int | None, str | None]]:
    """`kubectl scale` the running job to `replicas`; the sizes its status went through until it runs at it."""
    watch = Watch(op, "trainingjob", name, tmp_path / f"{name}-{replicas}.json")
    try:
        done = scale(op, name, replicas)
        assert "scaled" in done.stdout
        settled(op, name, replicas)
        watch.caught_up(lambda job: running_at(job.get("status") or {}, replicas))
    finally:
        versions = watch.stop()
    return sizes(versions)


def uids(pods: dict[str, dict]) -> dict[str, str]:
    return {name: p["metadata"]["uid"] for name, p in pods.items()}


def test_kubectl_scale_resizes_a_parameter_server_job_live(operator, tmp_path):
    doc = manifest()
    name = doc["metadata"]["name"]
    ps, w0, w1, w2 = (f"{name}-{r}" for r in ("ps-0", "worker-0", "worker-1", "worker-2"))
    operator.apply(doc)
    before = uids(running_set(operator, name, {"ps-0", "worker-0", "worker-1"}))
    status = settled(operator, name, 2)
    assert status["selector"] == f"kubetrain.dev/job-name={name},kubetrain.dev/role=worker"

    went = resize(operator, name, 3, tmp_path)
    # Live: status.replicas goes from 2 to 3 in one step, never through Restarting.
    assert went == [(2, None), (3, None)], went
    pods = running_set(operator, name, {"ps-0", "worker-0", "worker-1", "worker-2"})
    assert {n: u for n, u in uids(pods).items() if n != w2} == before  # nothing stopped or replaced
    assert pods[ps]["metadata"]["annotations"]["kubetrain.dev/size"] == "3"  # the kubelet remounts the job file
    spec = job_file(operator, name)["spec"]
    assert spec["replicas"] == 3 and spec["parameterServer"]["workers"] == 3
    status = operator.job_status(name)
    assert status["restarts"] == 0 and status["workers"] == 3
    assert status["replicaStatuses"]["worker"]["active"] == 3
    seen = reasons(operator, name)
    assert "Resized" in seen and "Resizing" not in seen, seen
    assert any(e["reason"] == "Resized" and e["message"].startswith("Resized from 2 to 3 workers, live: worker-2 joins")
               for e in operator.events(name))
    scaled = scale_subresource(operator, name)
    assert scaled["kind"] == "Scale" and scaled["spec"] == {"replicas": 3}
    assert scaled["status"] == {"replicas": 3, "selector": f"kubetrain.dev/job-name={name},kubetrain.dev/role=worker"}
    # What the selector selects is what status.replicas counts.
    assert len(operator.items("pods", scaled["status"]["selector"])) == 3
    # The job file was rendered again before the new worker was made and before ps-0 was told.
    log = operator.log.read_text()
    rendered = log.index(f"ConfigMap {name}-config rendered again at size 3")
    assert rendered < log.index(f"created pod {w2}")
    assert rendered < log.index(f"annotated pod {ps} with kubetrain.dev/size=3")

    went = resize(operator, name, 1, tmp_path)
    assert went == [(3, None), (1, None)], went
    assert job_file(operator, name)["spec"]["parameterServer"]["workers"] == 1
    left = pods_of(operator, name)
    assert left[ps]["metadata"]["annotations"]["kubetrain.dev/size"] == "1"
    # worker-1 and worker-2 run on until ps-0 releases them (RELEASE_GRACE_SECONDS, 120 s, at most): left alone,
    # and no longer counted.
    assert {w1, w2} <= set(left) and not any(left[w].get("metadata", {}).get("deletionTimestamp") for w in (w1, w2))
    status = operator.job_status(name)
    assert status["replicaStatuses"]["worker"] == {"active": 1, "succeeded": 0, "failed": 0}
    assert len(operator.items("pods", scaled["status"]["selector"])) == 3  # still there, not counted
    # Released, each ends as a trainer would: worker-1 exits 0, worker-2 is killed on its way out. kwok's
    # pods never end by themselves: their status is written as a kubelet would.
    operator.set_pod_status(w1, "Succeeded", exit_code=0)
    operator.set_pod_status(w2, "Failed", exit_code=137)
    operator.wait("worker-1 and worker-2 deleted", lambda: set(pods_of(operator, name)) == {ps, w0}, timeout=60)
    status = settled(operator, name, 1)
    assert status["restarts"] == 0 and status["state"] == "Running"
    assert status["replicaStatuses"]["worker"] == {"active": 1, "succeeded": 0, "failed": 0}
    assert uids(pods_of(operator, name)) == {n: before[n] for n in (ps, w0)}
    assert reasons(operator, name).count("Resized") == 2 and "Resizing" not in reasons(operator, name)
    assert not {"Killed", "Error", "Deleted"} & set(reasons(operator, name))
    assert scale_subresource(operator, name)["status"]["replicas"] == 1
    assert "forbidden" not in operator.log.read_text().lower()


def sts_sizes(versions: list[dict]) -> list[tuple[int, str]]:
    """(spec.replicas, torchrun's --nnodes in the pod template) of each StatefulSet version, repeats folded."""
    out: list[tuple[int, str]] = []
    for sts in versions:
        command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
        seen = (sts["spec"]["replicas"], command[command.index("--nnodes") + 1])
        if not out or out[-1] != seen:
            out.append(seen)
    return out


def nnodes(pod: dict) -> str:
    command = pod["spec"]["containers"][0]["command"]
    return command[command.index("--nnodes") + 1]


def test_kubectl_scale_resizes_a_ddp_job_statefulset_and_all(operator, tmp_path):
    doc = manifest(mode="DDP", ddp=DDP_ELASTIC)
    name = doc["metadata"]["name"]
    sts = f"{name}-ddp"
    operator.apply(doc)
    before = running_set(operator, name, {"ddp-0", "ddp-1"})
    settled(operator, name, 2)

    for size, old, ranks in [(1, 2, {"ddp-0"}), (2, 1, {"ddp-0", "ddp-1"})]:
        watch = Watch(operator, "statefulset", sts, tmp_path / f"sts-{size}.json")
        try:
            went = resize(operator, name, size, tmp_path)
            pods = running_set(operator, name, ranks, {p["metadata"]["uid"] for p in before.values()})
            watch.caught_up(lambda version: version["spec"]["replicas"] == size)
        finally:
            versions = watch.stop()
        assert went[0] == (old, None) and (old, "Resizing") in went and went[-1] == (size, None), went
        # The group goes to 0 under its old template; its size and template change together, in one patch.
        assert sts_sizes(versions) == [(old, str(old)), (0, str(old)), (size, str(size))], sts_sizes(versions)
        assert {nnodes(p) for p in pods.values()} == {str(size)}
        assert job_file(operator, name)["spec"]["ddp"]["nodes"] == size
        status = operator.job_status(name)
        assert status["restarts"] == 0 and status["workers"] == size
        seen = scale_subresource(operator, name)
        assert seen["spec"] == {"replicas": size}
        assert seen["status"] == {"replicas": size, "selector": f"kubetrain.dev/job-name={name},kubetrain.dev/role=ddp"}
        before = pods
    assert reasons(operator, name).count("Resized") == 2
    assert "forbidden" not in operator.log.read_text().lower()


@pytest.mark.parametrize("mode, spec, replicas, message", [
    ("DDP", {"ddp": DDP_ELASTIC}, 3,
     "replicas: a DDP job runs between ddp.minNodes and ddp.maxNodes nodes (each ddp.nodes when unset)"),
    ("DDP", {"ddp": DDP_ELASTIC}, 0, "spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1"),
    ("Single", {}, 2, "replicas: a Single job has one replica"),
    ("ParameterServer", {"parameterServer": {"workers": 2, "standbyWorkers": 1}}, 3,
     "replicas: a job with parameterServer.standbyWorkers keeps the size it was created with"),
], ids=["ddp-above-maxNodes", "ddp-zero", "single-two", "ps-with-standbys"])
def test_the_api_server_refuses_a_size_the_job_cannot_take(operator, mode, spec, replicas, message):
    doc = manifest(mode=mode, **spec)
    name = doc["metadata"]["name"]
    operator.apply(doc)
    job = operator.get("trainingjob", name)
    done = scale(operator, name, replicas, check=False)
    assert done.returncode != 0, done.stdout
    assert message in done.stderr, done.stderr
    after = operator.get("trainingjob", name)
    assert after["spec"] == job["spec"] and after["metadata"]["generation"] == job["metadata"]["generation"]
    assert "Resizing" not in reasons(operator, name)


def test_a_job_file_taken_over_by_another_is_not_overwritten_by_a_resize(operator):
    """The resize patches only the job's own ConfigMap: one of the same name made by someone else
    meanwhile is reported (ChildConflict) and left as it is; once it is gone, the job file is made
    again at the new size and the job goes on."""
    doc = manifest(mode="DDP", ddp=DDP_ELASTIC)
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_set(operator, name, {"ddp-0", "ddp-1"})
    settled(operator, name, 2)
    operator.kubectl("delete", "configmap", f"{name}-config")
    operator.kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
                         "data": {"job.yaml": "someone else's"}})
    scale(operator, name, 1)
    status = operator.wait("a ChildConflict condition", lambda: (s := operator.job_status(name)) and any(
        c["reason"] == "ChildConflict" for c in s.get("conditions", [])) and s, timeout=60)
    message = next(c["message"] for c in status["conditions"] if c["reason"] == "ChildConflict")
    assert f"ConfigMap {operator.namespace}/{name}-config exists and is not owned by this job" in message
    assert operator.get("configmap", f"{name}-config")["data"] == {"job.yaml": "someone else's"}
    assert pods_of(operator, name) == {}  # nothing starts on another's job file
    operator.kubectl("delete", "configmap", f"{name}-config")
    running_set(operator, name, {"ddp-0"})
    settled(operator, name, 1)
    owned = operator.get("configmap", f"{name}-config")
    assert owned["metadata"]["ownerReferences"][0]["name"] == name
    assert yaml.safe_load(owned["data"]["job.yaml"])["spec"]["ddp"]["nodes"] == 1
