"""A hostile tenant, with the right to create TrainingJobs in a namespace, against the real operator.

Each test here was a way around the first pass's defences (issue 31): a chief that stalls its
/metrics answer held a reconcile worker (eight of them, the whole operator); a null in the
template removed kubetrain's hardening; a pod labelled as another job's replica was counted as
that job's; a spec nested hundreds of levels, or a 400-digit number in a termination message,
raised in every round of its job with nothing on its status.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid

import pytest

from test_lifecycle import condition, manifest, pods_of, running_pods

pytestmark = pytest.mark.cluster


def create_json(op, doc: dict, check: bool = True):
    """`kubectl create` of a manifest as JSON (YAML's own dumper recurses: no deep documents)."""
    return op.kube.run("create", "-f", "-", input=json.dumps(doc), check=check)


def shared_claim(op) -> dict:
    """A claim of the operator's namespace, bound to a PersistentVolume of its own, for many jobs'
    checkpoint.storage.existingClaim: the session's static volumes (tests/operator/conftest.py) are
    too few for a test's dozen jobs after the other tests took theirs."""
    name = f"shared-{op.namespace}"
    op.cluster.kube().apply({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/{name}"},
                 "claimRef": {"namespace": op.namespace, "name": "shared"}}})
    op.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "shared"},
              "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": name,
                       "resources": {"requests": {"storage": "1Gi"}}}})
    op.wait("the shared claim bound", lambda: (op.get("persistentvolumeclaim", "shared") or {}).get(
        "status", {}).get("phase") == "Bound")
    return {"storage": {"existingClaim": "shared", "accessMode": "ReadWriteMany"}}


@contextlib.contextmanager
def own_operator_with_a_victim(cluster, operator, spawn_operator, prefix: str):
    """An operator of its own watching a new namespace, and a Single job `victim` running there, whose
    reconcile the test's hostile jobs must not hold up: (the operator's handle, its process, a claim for
    many jobs' checkpoints). The namespace goes at the end."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        proc = spawn_operator(namespace)
        op = type(operator)(cluster, namespace, proc.log, proc.metrics_port)
        storage = shared_claim(op)
        op.apply(manifest(mode="Single", name="victim", checkpoint=storage))
        running_pods(op, "victim", 1)
        op.wait("the victim Running", lambda: op.job_status("victim").get("state") == "Running")
        yield op, proc, storage
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


@pytest.fixture(scope="module")
def storage(operator) -> dict:
    return shared_claim(operator)


def status_of(op, name: str) -> dict:
    """The job's status alone (the whole object, deeply nested, is more than this process's JSON decoder reads)."""
    return json.loads(op.kubectl("get", "trainingjob", name, "-o", "jsonpath={.status}") or "{}")


def failed_status(op, name: str, timeout: float = 60) -> dict:
    return op.wait(f"{name} Failed", lambda: (s := status_of(op, name)).get("state") == "Failed" and s, timeout=timeout)


# --- a chief that stalls its /metrics answer -----------------------------------------------------

class Stalling:
    """A loopback /metrics server that stalls every answer: `kind` "headers" (a status line, then a
    header byte every DRIP_EVERY s), "status" (the status line itself a byte at a time) or "silent"
    (reads the request, sends nothing). Each connection lasts up to HOLD_SECONDS unless the client
    hangs up; `cut` counts those it hung up, `seen` all of them."""

    HOLD_SECONDS = 600.0
    DRIP_EVERY = 0.5

    def __init__(self, kind: str):
        self.kind = kind
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.seen = self.cut = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.seen += 1
            threading.Thread(target=self._stall, args=(conn,), daemon=True).start()

    def _stall(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                if self.kind == "silent":
                    conn.settimeout(self.HOLD_SECONDS)
                    hung_up = conn.recv(1) == b""
                else:
                    text = (b"HTTP/1.1 200 OK\r\n" if self.kind == "headers" else b"") + b"X" * 10_000
                    start = 17 if self.kind == "headers" else 0
                    if start:
                        conn.sendall(text[:start])
                    deadline = time.monotonic() + self.HOLD_SECONDS
                    while time.monotonic() < deadline and not self.closed:
                        conn.sendall(text[start:start + 1])
                        start += 1
                        time.sleep(self.DRIP_EVERY)
                    hung_up = False
            except OSError:
                hung_up = True
            if hung_up and not self.closed:
                with self.lock:
                    self.cut += 1

    def close(self) -> None:
        self.closed = True
        self.listener.close()


HOSTILE = {"headers": 6, "status": 5, "silent": 3}
"""Chiefs of each kind: 11 that drip, more than the operator's 8 reconcile workers (each used to hold
one for as long as it dripped), and some that say nothing at all."""


def test_chiefs_that_stall_their_metrics_never_stall_another_jobs_reconcile(cluster, operator, spawn_operator):
    with own_operator_with_a_victim(cluster, operator, spawn_operator, "scr") as (op, _, storage):
        servers = {kind: Stalling(kind) for kind in HOSTILE}
        try:
            hostile = []
            for kind, count in HOSTILE.items():
                for i in range(count):
                    doc = manifest(mode="Single", name=f"{kind}-{i}", metrics={"port": servers[kind].port},
                                   checkpoint=storage)
                    op.apply(doc)
                    hostile.append(doc["metadata"]["name"])
            for name in hostile:
                running_pods(op, name, 1)
                op.set_pod_status(f"{name}-single-0", "Running", pod_ip="127.0.0.1")
            for kind in ("headers", "status"):
                op.wait(f"the operator scraping the {kind} chiefs", lambda: servers[kind].seen >= 1, timeout=60)
            # Another job's replica fails: its round must come, and restart it, while the chiefs stall.
            old = op.get("pod", "victim-single-0")["metadata"]["uid"]
            op.set_pod_status("victim-single-0", "Failed", exit_code=1)
            op.wait("the victim's failure handled (a restart counted)",
                    lambda: op.job_status("victim").get("restarts") == 1, timeout=90)
            op.wait("the victim's replacement pod",
                    lambda: (p := op.get("pod", "victim-single-0")) and p["metadata"]["uid"] != old, timeout=90)
            # Every kind of stall was cut at the scrape's deadline, not held for as long as the chief chose.
            for kind, server in servers.items():
                op.wait(f"a {kind} chief's scrape cut off by the operator", lambda: server.cut >= 1, timeout=60)
        finally:
            for server in servers.values():
                server.close()


# --- the template: nulls, kubetrain's labels, another job's pods ----------------------------------

def test_a_null_in_the_template_fails_the_job_naming_the_field_and_no_pod_is_made(operator, storage):
    """The API server keeps a null in podTemplate (its schema preserves unknown fields); the merge
    once copied it over kubetrain's `runAsNonRoot: true`."""
    doc = manifest(mode="Single", checkpoint=storage, podTemplate={"spec": {
        "securityContext": {"runAsNonRoot": None},
        "containers": [{"name": "trainer", "securityContext": {"allowPrivilegeEscalation": None}}]}})
    name = doc["metadata"]["name"]
    create_json(operator, doc)
    stored = operator.get("trainingjob", name)["spec"]["podTemplate"]["spec"]
    assert stored["securityContext"] == {"runAsNonRoot": None}, stored  # what the operator reads
    status = failed_status(operator, name)
    failed = condition(status, "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "spec.podTemplate.spec.securityContext.runAsNonRoot: must not be null" in failed["message"]
    assert "spec.podTemplate.spec.containers[0].securityContext.allowPrivilegeEscalation: must not be null" \
        in failed["message"]
    assert pods_of(operator, name) == {}


def test_a_null_anywhere_in_spec_fails_the_job_naming_the_field_and_no_pod_is_made(operator, storage):
    """Not only podTemplate.spec: the API server keeps a null in every free-form field (model.args, a role's
    resource claims, the template's metadata beyond its labels), which went on to the trainer's model code
    or the pods. Each is named; no pod is made."""
    doc = manifest(mode="Single", checkpoint=storage, model={"name": "mlp", "args": {"hidden": None}},
                   resources={"worker": {"claims": [None]}}, podTemplate={"metadata": {"finalizers": None}})
    name = doc["metadata"]["name"]
    create_json(operator, doc)
    stored = operator.get("trainingjob", name)["spec"]
    assert stored["model"]["args"] == {"hidden": None} and stored["resources"]["worker"]["claims"] == [None]
    failed = condition(failed_status(operator, name), "Failed")
    assert failed["reason"] == "InvalidSpec"
    for path in ("spec.model.args.hidden", "spec.resources.worker.claims[0]", "spec.podTemplate.metadata.finalizers"):
        assert f"{path}: must not be null" in failed["message"], failed["message"]
    assert pods_of(operator, name) == {}


def test_a_pod_labelled_as_another_jobs_replica_is_not_that_jobs(operator, storage):
    """A pod in the namespace labelled `kubetrain.dev/job-name: victim` (made by a tenant who may create
    pods, or by a template before such labels were refused) used to be filed under the victim: its
    success, with forged results, ended the victim's training."""
    doc = manifest(mode="Single", checkpoint=storage)
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 1)
    attacker = manifest(mode="Single", checkpoint=storage)
    operator.apply(attacker)
    attacker_uid = operator.wait("the attacker's uid", lambda: (j := operator.get("trainingjob", attacker["metadata"]["name"]))
                                 and j["metadata"]["uid"])
    forged = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-forged", "labels": {"kubetrain.dev/job-name": name, "kubetrain.dev/role": "single",
                                             "kubetrain.dev/replica": "single-0"},
        "ownerReferences": [{"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                             "name": attacker["metadata"]["name"], "uid": attacker_uid, "controller": True}]},
        "spec": {"containers": [{"name": "trainer", "image": "busybox"}]}}
    operator.apply(forged)
    operator.wait("the forged pod placed by kwok", lambda: (operator.get("pod", f"{name}-forged") or {}).get(
        "status", {}).get("phase") == "Running")
    forged_results = {"phase": "Succeeded", "containerStatuses": [{
        "name": "trainer", "image": "busybox", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": json.dumps({"global_step": 999})}}}]}
    operator.kubectl("patch", "pod", f"{name}-forged", "--subresource=status", "--type=merge", "-p",
                     json.dumps({"status": forged_results}))
    # The victim's own pod ends with its own results: those, not the forged ones, are the job's.
    own = json.loads(json.dumps(forged_results).replace("999", "7"))
    operator.kubectl("patch", "pod", f"{name}-single-0", "--subresource=status", "--type=merge", "-p",
                     json.dumps({"status": own}))
    status = operator.wait("the victim Succeeded", lambda: (s := operator.job_status(name)).get("state") == "Succeeded"
                           and s)
    assert status["progress"]["step"] == 7, status["progress"]
    assert status.get("restarts", 0) == 0
    assert operator.get("pod", f"{name}-forged") is not None  # not the victim's to delete either


def test_a_pod_owned_by_another_statefulset_of_the_jobs_name_is_not_its_rank(operator):
    """A tenant who may create pods makes one whose controller is `<victim>-ddp` by name, of any uid,
    labelled as the victim's rank 0 and finished with forged results. Its owner reference names an
    apiVersion no API serves, so the garbage collector never resolves the owner and never deletes the
    pod. The operator checked the StatefulSet's name alone: the pod was filed as the victim's ddp-0 and
    the victim Succeeded with the forged step (a forged failure would have spent its restarts). Now
    only the StatefulSet the operator knows as the job's (its uid) owns the job's ranks."""
    doc = manifest(mode="DDP")
    doc["spec"]["ddp"]["nodes"] = 1  # one rank: its end is the job's
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 1)
    real_uid = operator.get("statefulset", f"{name}-ddp")["metadata"]["uid"]
    forged_uid = str(uuid.uuid4())
    assert forged_uid != real_uid
    forged = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-forged", "labels": {"kubetrain.dev/job-name": name, "kubetrain.dev/role": "ddp",
                                             "kubetrain.dev/replica": "ddp-0"},
        "ownerReferences": [{"apiVersion": "forged.example/v1", "kind": "StatefulSet", "name": f"{name}-ddp",
                             "uid": forged_uid, "controller": True}]},
        "spec": {"containers": [{"name": "trainer", "image": "busybox"}]}}
    operator.apply(forged)
    operator.wait("the forged pod placed by kwok", lambda: (operator.get("pod", f"{name}-forged") or {}).get(
        "status", {}).get("phase") == "Running")

    def ended(step: int) -> str:
        return json.dumps({"status": {"phase": "Running", "containerStatuses": [{
            "name": "trainer", "image": "busybox", "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                     "message": json.dumps({"global_step": step})}}}]}})

    operator.kubectl("patch", "pod", f"{name}-forged", "--subresource=status", "--type=merge", "-p", ended(999))
    deadline = time.monotonic() + 8  # the pod's event reaches a round within a second
    while time.monotonic() < deadline:
        status = operator.job_status(name)
        assert status.get("state") != "Succeeded", "the forged rank 0 ended the victim"
        assert not status.get("restarts"), "the forged rank 0 was taken for a new incarnation: a restart"
        time.sleep(0.5)
    # The victim's own rank 0 ends with its own results: those, not the forged ones, are the job's.
    operator.kubectl("patch", "pod", f"{name}-ddp-0", "--subresource=status", "--type=merge", "-p", ended(7))
    status = operator.wait("the victim Succeeded", lambda: (s := operator.job_status(name)).get("state") == "Succeeded"
                           and s)
    assert status["progress"]["step"] == 7, status["progress"]
    assert status.get("restarts", 0) == 0
    assert operator.get("pod", f"{name}-forged") is not None  # not the victim's to delete either


def test_another_jobs_checkpoint_claim_is_not_a_jobs_existing_claim(operator):
    """checkpoint.storage.existingClaim may name any claim of the namespace: once, another job's
    checkpoint claim, whose checkpoints the pods could then read or overwrite."""
    victim = manifest(mode="Single")
    operator.apply(victim)
    claim = f"{victim['metadata']['name']}-ckpt-single-0"
    operator.wait("the victim's claim", lambda: operator.get("persistentvolumeclaim", claim))
    doc = manifest(mode="Single", checkpoint={"storage": {"existingClaim": claim}})
    name = doc["metadata"]["name"]
    operator.apply(doc)
    failed = condition(failed_status(operator, name), "Failed")
    assert failed["reason"] == "PodSecurity"
    assert failed["message"].startswith(f"spec.checkpoint.storage.existingClaim: '{claim}' is job "
                                        f"{victim['metadata']['name']}'s checkpoint claim; "), failed["message"]
    assert "podSecurity.allow: [claims]" in failed["message"]
    assert pods_of(operator, name) == {}


# --- bounds on what the operator reads ------------------------------------------------------------

NESTED = "nested-placeholder"


def with_nesting(doc: dict, levels: int) -> str:
    """The manifest as JSON with `levels` objects nested in place of NESTED (json.dumps recurses)."""
    return json.dumps(doc).replace(json.dumps(NESTED), '{"a": ' * levels + '"x"' + "}" * levels)


@pytest.mark.parametrize("levels", [100, 900, 3000, 9980])  # 9,980: at the API server's own limit (10,000 in all)
def test_a_spec_nested_past_the_limit_fails_with_invalid_spec(operator, storage, levels):
    """The API server accepts far deeper objects than a TrainingJob's limit (64): 100 levels were
    accepted and run; 900 raised RecursionError in every event of the job, with nothing on its status;
    3,000 broke the operator's watch of every job (its JSON decoder's recursion). Each fails with
    InvalidSpec, and the jobs after it are reconciled as ever."""
    doc = manifest(mode="Single", checkpoint=storage, podTemplate={"spec": {"affinity": NESTED}})
    name = doc["metadata"]["name"]
    done = operator.kube.run("create", "-f", "-", input=with_nesting(doc, levels), check=False)
    if done.returncode != 0:
        pytest.fail(f"the API server refused {levels} levels, so this test cannot show the operator's bound: "
                    f"{done.stderr[-500:]}")
    failed = condition(failed_status(operator, name), "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "nests deeper than 64 levels" in failed["message"], failed["message"]
    assert pods_of(operator, name) == {}
    after = manifest(mode="Single", checkpoint=storage)
    operator.apply(after)
    running_pods(operator, after["metadata"]["name"], 1)


def test_a_huge_number_in_a_termination_message_is_dropped(operator, storage):
    """A 400-digit integer in the chief's termination message (the trainer's results, the tenant's to
    write) raised OverflowError in every round of its job; the job ends as if it were not there."""
    doc = manifest(mode="Single", checkpoint=storage)
    name = doc["metadata"]["name"]
    operator.apply(doc)
    running_pods(operator, name, 1)
    message = json.dumps({"global_step": int("9" * 400), "steps": 5, "final_train_loss": 0.5})
    ended = {"phase": "Succeeded", "containerStatuses": [{
        "name": "trainer", "image": "busybox", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": message}}}]}
    operator.kubectl("patch", "pod", f"{name}-single-0", "--subresource=status", "--type=merge", "-p",
                     json.dumps({"status": ended}))
    status = operator.wait("Succeeded", lambda: (s := operator.job_status(name)).get("state") == "Succeeded" and s)
    assert status["progress"]["step"] == 5
    assert "OverflowError" not in operator.log.read_text()
