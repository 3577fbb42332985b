"""Kueue admits TrainingJobs as one unit: the real Kueue manager (sigs.k8s.io/kueue v0.17.0, built
by hack/kueue) and `kubetrain operator --kueue` against the test cluster, pods on kwok's fake nodes.

Each job is a parameter-server job of three pods (one shard, two workers) asking 1 CPU each; the
ClusterQueue's quota (4 CPUs) fits one such job and not two: a per-pod scheduler would start one
pod of the second job, Kueue starts none until the whole job fits.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from helpers import kueue as kueue_helper
from helpers.net import free_port
from helpers.process import run
from helpers.wait import wait_for
from kubetrain.engine.kueue import PRIORITY_LABEL, QUEUE_LABEL, SLICE_FOR

from test_lifecycle import condition, manifest, pods_of

pytestmark = pytest.mark.cluster

CPU_QUOTA = 4
MEMORY_QUOTA = "64Gi"
"""Memory is covered too, far from binding: a fault-tolerant job's Lighthouse requests memory
(engine/children.LIGHTHOUSE_RESOURCES), and Kueue admits no pod set that requests a resource its
ClusterQueue does not cover."""
POOL = {"type": "kwok"}  # a label kwok's fake nodes carry: the flavor's nodeLabels, so the pods land on them


def test_hack_kueue_run_refuses_to_start_when_it_cannot_read_its_crds(tmp_path):
    """An API server that does not answer: `hack/kueue run` names it and exits 1, Kueue never started."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                               "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {}}]}))
    done = run(str(kueue_helper.HACK_KUEUE), "run", str(tmp_path / "work"),
               env={**os.environ, "KUBECONFIG": str(kubeconfig)}, check=False, timeout=60)
    assert done.returncode == 1, done
    assert "could not read Kueue's CRDs from the cluster" in done.stderr and str(kubeconfig) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stderr.lower(), done.stderr


@pytest.fixture(scope="module")
def kueue(cluster, crd, volumes, tmp_path_factory):
    kueue_helper.install_crds(cluster)
    with kueue_helper.running(cluster, tmp_path_factory.mktemp("kueue")) as log:
        yield log


def queue_objects(name: str, namespace: str, preemption: bool = False) -> list[dict]:
    cq_spec = {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
        {"name": name, "resources": [{"name": "cpu", "nominalQuota": CPU_QUOTA},
                                     {"name": "memory", "nominalQuota": MEMORY_QUOTA}]}]}]}
    if preemption:
        cq_spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": {"nodeLabels": POOL}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": cq_spec},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": namespace},
         "spec": {"clusterQueue": name}},
    ]


@pytest.fixture
def queue(cluster, kueue, spawn_operator, request):
    """A namespace with a LocalQueue `team` on a ClusterQueue of CPU_QUOTA CPUs, and an operator
    with --kueue watching it; yields the Operator handle (its namespace is the queue's)."""
    yield from queue_with(cluster, spawn_operator, getattr(request, "param", False))


@pytest.fixture
def slices_queue(cluster, kueue, spawn_operator):
    """`queue`, its operator with --kueue-workload-slices too."""
    yield from queue_with(cluster, spawn_operator, False, "--kueue-workload-slices")


def queue_with(cluster, spawn_operator, preemption: bool, *args: str):
    name = f"kq-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    kube = cluster.kube()
    kube.apply(*queue_objects(name, name, preemption), server_side=True)
    proc = spawn_operator(name, "--kueue", *args)
    op = proc.handle(cluster, name)
    op.wait("ClusterQueue active", lambda: condition((kube.get("clusterqueue", name) or {}).get("status") or {}, "Active")
            and condition(kube.get("clusterqueue", name)["status"], "Active")["status"] == "True",
            timeout=30)
    op.wait("the operator to start", lambda: proc.proc.poll() is not None or "startup" in proc.log.read_text().lower())
    assert proc.proc.poll() is None, proc.log.read_text()
    try:
        yield op
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false")
        cluster.kubectl("delete", "clusterqueue,resourceflavor", name, "--wait=false")


@pytest.fixture
def priorities(queue, cluster):
    """WorkloadPriorityClasses `<namespace>-low` (100) and `<namespace>-high` (1000), deleted afterwards."""
    kube = cluster.kube()
    wpc = [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
            "metadata": {"name": f"{queue.namespace}-{level}"}, "value": value} for level, value in (("low", 100), ("high", 1000))]
    kube.apply(*wpc, server_side=True)
    yield
    kube("delete", "workloadpriorityclass", *(w["metadata"]["name"] for w in wpc), "--wait=false")


def queued_job(priority: str | None = None) -> dict:
    doc = manifest(resources={"ps": {"requests": {"cpu": "1"}}, "worker": {"requests": {"cpu": "1"}}})
    doc["metadata"]["labels"] = {QUEUE_LABEL: "team", **({PRIORITY_LABEL: priority} if priority else {})}
    return doc


def workload_of(op, job: str) -> dict | None:
    found = op.items("workloads.kueue.x-k8s.io", f"kubetrain.dev/job-name={job}")
    return found[0] if found else None


def finish(op, job: str) -> None:
    """What the kubelet would report when every replica exits 0."""
    for pod in pods_of(op, job):
        op.set_pod_status(pod, "Succeeded", exit_code=0)


def all_running(op, job: str, n: int = 3):
    return op.wait(f"{n} running pods of {job}", lambda: (p := pods_of(op, job)) and len(p) == n and all(
        x["status"].get("phase") == "Running" and not x["metadata"].get("deletionTimestamp") for x in p.values()) and p,
        timeout=60)


def suspended_by(op, job: str, reason: str, saying: str) -> dict:
    """The job's Suspended condition once it has `reason` and its message says `saying` (Kueue's words
    arrive a moment after the Workload is created)."""
    return wait_for(f"{job} Suspended with reason {reason} saying {saying!r}", lambda: (s := op.job_status(job)).get(
        "state") == "Suspended" and (c := condition(s, "Suspended")) and c["reason"] == reason
        and saying in c["message"] and c, timeout=60, explain=lambda: explain(op))


def explain(op) -> str:
    """The jobs' and Workloads' conditions, and the operator's log tail, for a failed wait."""
    lines = []
    for kind in ("trainingjobs", "workloads.kueue.x-k8s.io"):
        for obj in op.kube.items(kind):
            conds = [(c["type"], c["status"], c.get("reason"), c.get("message", "")[:160])
                     for c in (obj.get("status") or {}).get("conditions") or []]
            lines.append(f"{kind} {obj['metadata']['name']}: {conds}")
    return "\n".join(lines + ["operator log:"] + op.log.read_text().splitlines()[-20:])


def test_the_queue_admits_one_whole_job_and_the_second_waits_with_kueues_reason_until_the_first_ends(queue):
    op = queue
    first, second = queued_job(), queued_job()
    a, b = first["metadata"]["name"], second["metadata"]["name"]
    op.apply(first)
    pods = all_running(op, a)
    assert all(p["spec"]["nodeSelector"] == POOL for p in pods.values())  # the flavor's nodeLabels
    wl = workload_of(op, a)
    assert {s["name"]: s["count"] for s in wl["spec"]["podSets"]} == {"ps": 1, "worker": 2}
    assert wl["metadata"]["ownerReferences"][0]["name"] == a

    op.apply(second)
    suspended_by(op, b, "QueuedForAdmission", "insufficient unused quota for cpu")
    assert pods_of(op, b) == {}  # not one pod of the job that does not fit
    assert [e for e in op.events(b) if e["reason"] == "QueuedForAdmission"]
    # A Workload deleted from outside is created again, and the job keeps waiting on it.
    gone = workload_of(op, b)["metadata"]["uid"]
    op.kubectl("delete", "workloads.kueue.x-k8s.io", workload_of(op, b)["metadata"]["name"])
    op.wait(f"a new Workload for {b}", lambda: (w := workload_of(op, b)) and w["metadata"]["uid"] != gone)
    suspended_by(op, b, "QueuedForAdmission", "insufficient unused quota for cpu")
    assert pods_of(op, b) == {}

    finish(op, a)
    op.wait(f"{a} Succeeded", lambda: op.job_status(a).get("state") == "Succeeded")
    done = op.wait("the first Workload Finished", lambda: condition((workload_of(op, a) or {}).get("status") or {},
                                                                    "Finished"))
    assert done["reason"] == "Succeeded"
    all_running(op, b)
    op.wait(f"{b} Running", lambda: op.job_status(b).get("state") == "Running")


@pytest.mark.parametrize("queue", [True], indirect=True)
def test_a_higher_priority_job_preempts_the_lower_which_resumes_when_it_ends(queue, priorities):
    op = queue
    low, high = queued_job(f"{op.namespace}-low"), queued_job(f"{op.namespace}-high")
    lo, hi = low["metadata"]["name"], high["metadata"]["name"]
    op.apply(low)
    before = all_running(op, lo)
    assert workload_of(op, lo)["spec"]["priority"] == 100
    claim = next(v for v in before[f"{lo}-ps-0"]["spec"]["volumes"] if v["name"] == "data")

    op.apply(high)
    suspended_by(op, lo, "Preempted", "due to prioritization in the ClusterQueue")
    all_running(op, hi)  # the quota came back once the low job's pods were gone
    assert pods_of(op, lo) == {}
    wl = workload_of(op, lo)
    assert condition(wl["status"], "Requeued")["status"] == "True"
    assert condition(wl["status"], "QuotaReserved")["status"] == "False"
    assert op.job_status(lo)["restarts"] == 0  # a preemption is no failure

    finish(op, hi)
    after = all_running(op, lo)
    # The status follows the pods: the operator's next round after they run (as the test above waits for).
    op.wait(f"{lo} Running", lambda: op.job_status(lo).get("state") == "Running")
    assert [e for e in op.events(lo) if e["reason"] == "Resumed"]
    # The shard mounts the same checkpoint claim: the trainer resumes from its newest checkpoint.
    assert next(v for v in after[f"{lo}-ps-0"]["spec"]["volumes"] if v["name"] == "data") == claim


@pytest.mark.parametrize("queue", [True], indirect=True)
def test_a_preempted_ddp_job_is_scaled_to_zero_and_scaled_back_when_readmitted(queue, priorities):
    """DDP's ranks are a StatefulSet's pods: created only once admitted (with the flavor's node
    selector in its template), scaled to zero on preemption, back to full size on re-admission."""
    op = queue
    low = manifest("DDP", resources={"worker": {"requests": {"cpu": "1"}}})
    low["metadata"]["labels"] = {QUEUE_LABEL: "team", PRIORITY_LABEL: f"{op.namespace}-low"}
    lo = low["metadata"]["name"]
    op.apply(low)
    all_running(op, lo, 2)
    sts = op.get("statefulset", f"{lo}-ddp")
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == POOL
    assert {s["name"]: s["count"] for s in workload_of(op, lo)["spec"]["podSets"]} == {"ddp": 2}

    high = queued_job(f"{op.namespace}-high")  # 3 CPUs: with the DDP job's 2, over the quota of 4
    hi = high["metadata"]["name"]
    op.apply(high)
    suspended_by(op, lo, "Preempted", "due to prioritization in the ClusterQueue")
    all_running(op, hi)
    assert op.get("statefulset", f"{lo}-ddp")["spec"]["replicas"] == 0 and pods_of(op, lo) == {}

    finish(op, hi)
    all_running(op, lo, 2)
    op.wait(f"{lo} Running", lambda: op.job_status(lo).get("state") == "Running")
    assert op.job_status(lo)["restarts"] == 0


def counts(wl: dict) -> dict[str, int]:
    return {s["name"]: s["count"] for s in wl["spec"]["podSets"]}


def scale(op, job: str, replicas: int) -> None:
    """What a user types: the CRD's scale subresource writes spec.replicas."""
    assert "scaled" in op.kubectl("scale", "trainingjob", job, f"--replicas={replicas}")


def new_workload(op, job: str, than: set[str], at: dict[str, int]) -> dict:
    """The job's Workload once it is another one than the uids in `than`, made at the pod counts `at`."""
    return wait_for(f"a new Workload of {job} with podSets {at}", lambda: (w := workload_of(op, job))
                    and w["metadata"]["uid"] not in than and counts(w) == at and w, timeout=60,
                    explain=lambda: explain(op))


def admitted(op, job: str, uid: str) -> dict:
    """The job's Workload `uid` once Kueue admitted it."""
    return wait_for(f"Workload {uid} of {job} admitted", lambda: (w := workload_of(op, job))
                    and w["metadata"]["uid"] == uid and (condition(w.get("status") or {}, "Admitted") or {}).get(
                        "status") == "True" and w, timeout=60, explain=lambda: explain(op))


HOLD = "kubetrain.dev/test-hold"
"""A finalizer of the test's own on a pod: the pod stays terminating until the test takes it off."""


def test_a_resized_job_gets_a_workload_at_its_new_counts_and_runs_at_the_size_kueue_admits(queue):
    """`kubectl scale` on a queued ParameterServer job. Kueue's pod sets are immutable once admitted: the
    operator deletes the Workload once the replicas of the old size are gone and makes it again at the
    new counts, the job held (its replicas stopped) until Kueue admits it. 2 -> 3 workers is 4 CPUs:
    admitted, the job runs at 3. 3 -> 5 is 6 CPUs, more than the ClusterQueue's 4: the job waits with no
    pod and Kueue's reason. 5 -> 2: admitted and running again. No restart is counted."""
    op = queue
    doc = queued_job()
    name = doc["metadata"]["name"]
    op.apply(doc)
    before = all_running(op, name)
    first = workload_of(op, name)
    assert counts(first) == {"ps": 1, "worker": 2}
    seen = {first["metadata"]["uid"]}

    # 2 -> 3 workers: 4 pods of 1 CPU, the whole quota. A finalizer keeps ps-0 terminating (as a trainer
    # writing its checkpoint would): meanwhile the job is held and its old Workload keeps its quota.
    ps0 = f"{name}-ps-0"
    op.kubectl("patch", "pod", ps0, "--type=merge", "-p", json.dumps({"metadata": {"finalizers": [HOLD]}}))
    scale(op, name, 3)
    suspended_by(op, name, "Resizing", "Resized to 3 workers: the job's Kueue Workload is made again")
    op.wait(f"{ps0} stopped", lambda: (pods_of(op, name).get(ps0) or {}).get("metadata", {}).get("deletionTimestamp"))
    assert workload_of(op, name)["metadata"]["uid"] == first["metadata"]["uid"]
    assert op.job_status(name)["replicas"] == 2
    op.kubectl("patch", "pod", ps0, "--type=json", "-p", json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]))
    wl = new_workload(op, name, seen, {"ps": 1, "worker": 3})
    seen.add(wl["metadata"]["uid"])
    wl = admitted(op, name, wl["metadata"]["uid"])
    assert {a["name"]: a["count"] for a in wl["status"]["admission"]["podSetAssignments"]} == {"ps": 1, "worker": 3}
    pods = all_running(op, name, 4)
    assert sorted(pods) == sorted(f"{name}-{r}" for r in ("ps-0", "worker-0", "worker-1", "worker-2"))
    assert all(p["spec"]["nodeSelector"] == POOL for p in pods.values())
    # Not live: the replicas of 2 were stopped (after a checkpoint) and those of 3 started.
    assert pods[f"{name}-ps-0"]["metadata"]["uid"] != before[f"{name}-ps-0"]["metadata"]["uid"]
    status = op.wait(f"{name} Running at 3", lambda: (s := op.job_status(name)).get("state") == "Running"
                     and s.get("replicas") == 3 and s)
    assert status["restarts"] == 0
    events = {e["reason"]: e["message"] for e in op.events(name)}
    assert events["Resizing"].startswith("Resized to 3 workers: the job's Kueue Workload is made again"), events
    assert events["Resized"].startswith("Resized from 2 to 3 workers while stopped"), events

    # 3 -> 5 workers: 6 CPUs, more than the ClusterQueue has at all. The job waits, no pod runs.
    scale(op, name, 5)
    wl = new_workload(op, name, seen, {"ps": 1, "worker": 5})
    seen.add(wl["metadata"]["uid"])
    waiting = suspended_by(op, name, "QueuedForAdmission", "> maximum capacity (4)")
    op.wait(f"no pod of {name}", lambda: pods_of(op, name) == {})
    status = op.job_status(name)
    print(f"\nwaiting at 5: replicas={status.get('replicas')} restarts={status.get('restarts')}\n"
          f"  Suspended: {waiting['reason']}: {waiting['message']}")
    assert status["state"] == "Suspended" and status["restarts"] == 0
    assert waiting["message"].startswith("Resized from 3 to 5 workers, not admitted at the new size yet. Waiting "
                                         "for Kueue to admit the job in LocalQueue team: "), waiting
    assert "insufficient quota for cpu" in waiting["message"]
    assert status["replicas"] == 3  # the size it last ran at
    held = workload_of(op, name)["status"]
    assert condition(held, "QuotaReserved")["status"] == "False" and "admission" not in held
    assert (condition(held, "Admitted") or {}).get("status") != "True"

    # 5 -> 2 workers: 3 CPUs, admitted again.
    scale(op, name, 2)
    wl = new_workload(op, name, seen, {"ps": 1, "worker": 2})
    admitted(op, name, wl["metadata"]["uid"])
    pods = all_running(op, name, 3)
    assert sorted(pods) == sorted(f"{name}-{r}" for r in ("ps-0", "worker-0", "worker-1"))
    status = op.wait(f"{name} Running at 2", lambda: (s := op.job_status(name)).get("state") == "Running"
                     and s.get("replicas") == 2 and s)
    assert status["restarts"] == 0
    resized = sorted((e for e in op.events(name) if e["reason"] == "Resized"),
                     key=lambda e: int(e["metadata"]["resourceVersion"]))
    print("Resized events:", [e["message"] for e in resized])
    assert [e["message"] for e in resized] == [
        f"Resized from {a} to {b} workers while stopped: the job resumes at the new size from its newest checkpoint."
        for a, b in ((2, 3), (3, 2))]


def test_a_resized_ddp_job_in_a_queue_runs_its_group_at_the_size_kueue_admits(queue):
    """`kubectl scale` on a queued DDP job, 2 -> 3 -> 1 nodes of 1 CPU (the ClusterQueue has 4). The group
    stops (its StatefulSet at 0) and the Workload is made again at the new count; once Kueue admits it,
    the StatefulSet runs at the new size with torchrun's --nnodes to match. No restart is counted."""
    op = queue
    doc = manifest("DDP", resources={"worker": {"requests": {"cpu": "1"}}})
    doc["spec"]["ddp"].update(minNodes=1, maxNodes=3)
    doc["metadata"]["labels"] = {QUEUE_LABEL: "team"}
    name = doc["metadata"]["name"]
    op.apply(doc)
    all_running(op, name, 2)
    first = workload_of(op, name)
    assert counts(first) == {"ddp": 2}
    seen = {first["metadata"]["uid"]}
    for size in (3, 1):
        scale(op, name, size)
        wl = new_workload(op, name, seen, {"ddp": size})
        seen.add(wl["metadata"]["uid"])
        wl = admitted(op, name, wl["metadata"]["uid"])
        assert {a["name"]: a["count"] for a in wl["status"]["admission"]["podSetAssignments"]} == {"ddp": size}
        pods = all_running(op, name, size)
        assert sorted(pods) == [f"{name}-ddp-{i}" for i in range(size)]
        sts = op.get("statefulset", f"{name}-ddp")
        command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
        assert sts["spec"]["replicas"] == size and command[command.index("--nnodes") + 1] == str(size)
        assert sts["spec"]["template"]["spec"]["nodeSelector"] == POOL
        status = op.wait(f"{name} Running at {size}", lambda: (s := op.job_status(name)).get("state") == "Running"
                         and s.get("replicas") == size and s)
        assert status["restarts"] == 0
    messages = [e["message"] for e in sorted((e for e in op.events(name) if e["reason"] in ("Resizing", "Resized")),
                                             key=lambda e: int(e["metadata"]["resourceVersion"]))]
    print("Resizing/Resized events:", messages)
    assert [m.split(":")[0].split(";")[0] for m in messages if m.startswith("Resized from")] == [
        "Resized from 2 to 3 nodes", "Resized from 3 to 1 nodes"]
    assert sum(m.startswith("Resized to") for m in messages) == 2  # the Workload made again, twice


def test_a_fault_tolerant_job_in_a_queue_resizes_live_by_workload_slices(slices_queue):
    """A queued fault-tolerant DDP job, 3 -> 2 -> 3 replica groups of 1 CPU (the ClusterQueue has 4), with
    Kueue's ElasticJobsViaWorkloadSlices gate (hack/kueue turns it on) and the operator's
    --kueue-workload-slices. Smaller: ddp-2 leaves, the others run on, and the admitted Workload's count is
    lowered in place (the same Workload). Larger: a slice at 3 (`workload-slice-replacement-for` the admitted
    one) is admitted by Kueue for the one CPU more, the old Workload Finished as WorkloadSliceReplaced, and
    ddp-2 starts; ddp-0 and ddp-1 are the same pods all along, the job never Suspended, no restart."""
    op = slices_queue
    doc = manifest("DDP", resources={"worker": {"requests": {"cpu": "1"}}})
    doc["spec"]["ddp"].update(nodes=3, minNodes=2, maxNodes=3, faultTolerance={})
    doc["metadata"]["labels"] = {QUEUE_LABEL: "team"}
    name = doc["metadata"]["name"]
    op.apply(doc)
    pods = all_running(op, name, 4)  # 3 groups and the Lighthouse
    survivors = {p: pods[p]["metadata"]["uid"] for p in (f"{name}-ddp-0", f"{name}-ddp-1")}
    first = workload_of(op, name)
    assert counts(first) == {"ddp": 3, "lighthouse": 1}, counts(first)

    def workloads() -> dict[str, dict]:
        return {w["metadata"]["name"]: w for w in op.items("workloads.kueue.x-k8s.io", f"kubetrain.dev/job-name={name}")}

    def never_stopped() -> None:
        now = pods_of(op, name)
        assert {p: now[p]["metadata"]["uid"] for p in survivors} == survivors, (
            [(e["reason"], e["message"]) for e in op.events(name)], explain(op))
        status = op.job_status(name)
        assert status.get("state") != "Suspended" and status.get("restarts", 0) == 0, status

    scale(op, name, 2)
    op.wait(f"{name} at 2 groups", lambda: sorted(pods_of(op, name)) == sorted([*survivors, f"{name}-lighthouse-0"]))
    lowered = wait_for("the Workload lowered in place", lambda: (w := workloads().get(first["metadata"]["name"]))
                       and counts(w) == {"ddp": 2, "lighthouse": 1} and w, timeout=60, explain=lambda: explain(op))
    assert lowered["metadata"]["uid"] == first["metadata"]["uid"] and len(workloads()) == 1
    never_stopped()

    scale(op, name, 3)
    grown = wait_for("a slice at 3 admitted", lambda: next(
        (w for w in workloads().values() if (w["metadata"].get("annotations") or {}).get(SLICE_FOR)
         == f"{op.namespace}/{first['metadata']['name']}" and counts(w) == {"ddp": 3, "lighthouse": 1}
         and (condition(w.get("status") or {}, "Admitted") or {}).get("status") == "True"), None),
        timeout=60, explain=lambda: explain(op))
    old = workloads()[first["metadata"]["name"]]
    finished = condition(old.get("status") or {}, "Finished") or {}
    assert finished.get("status") == "True" and finished.get("reason") == "WorkloadSliceReplaced", old.get("status")
    pods = all_running(op, name, 4)
    assert f"{name}-ddp-2" in pods
    never_stopped()
    status = op.wait(f"{name} Running at 3", lambda: (s := op.job_status(name)).get("replicas") == 3
                     and s.get("state") == "Running" and s)
    messages = [e["message"] for e in op.events(name) if e["reason"] in ("Resizing", "Resized")]
    print("Resized events:", messages, "slice", grown["metadata"]["name"])
    assert not any(m.startswith("Resized to") for m in messages), messages  # never made again, never stopped
    assert status["restarts"] == 0
