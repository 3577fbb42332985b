"""Two operators with leader election on the test cluster: one acts, the other stands by and takes over.

The takeover must change nothing that was already right: the new leader's first
rounds find the job's pods and children as the old leader left them.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid

import pytest

from helpers.kube import Kubectl
from helpers.metrics import samples, try_scrape
from helpers.wait import wait_for
from kubetrain.drivers.cluster.leader import LEASE_SECONDS, RETRY_SECONDS
from kubetrain.engine.engine import MAX_REQUEUE_SECONDS

pytestmark = pytest.mark.cluster

LEASE = "kubetrain-operator"
SLACK_SECONDS = 10
"""Beyond LEASE_SECONDS + RETRY_SECONDS: starting kubectl, a loaded 2-core machine."""


def holder(kube: Kubectl) -> str:
    lease = kube.get("lease", LEASE)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def gauge(p, name: str) -> float | None:
    text = try_scrape(f"127.0.0.1:{p.metrics_port}")
    return None if text is None else samples(text).get((name, frozenset()))


def healthz(p) -> dict | None:
    """The liveness endpoint's answer, or None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{p.liveness_port}/healthz", timeout=10) as reply:
            return json.loads(reply.read()) if reply.status == 200 else None
    except OSError:
        return None


def logs(*procs) -> str:
    return "\n".join(f"--- {p.log.name}\n" + "\n".join(p.log.read_text().splitlines()[-25:]) for p in procs)


@pytest.fixture
def namespace(cluster):
    ns = f"standby-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def leader_and_standby(spawn_operator, kube: Kubectl, namespace: str):
    """Two candidates started at once; returns (leader, standby) once one holds the lease and the
    other says it is waiting."""
    candidates = {name: spawn_operator(namespace, "--leader-elect", "--lease-namespace", namespace,
                                       env={"POD_NAME": name}) for name in ("op-a", "op-b")}

    def lease_holder() -> str:
        exited = [p.log.name for p in candidates.values() if p.proc.poll() is not None]
        assert not exited, f"{exited} exited:\n{logs(*candidates.values())}"
        return holder(kube)

    held = wait_for("one of the two to hold the lease", lease_holder, timeout=90,
                    explain=lambda: logs(*candidates.values()))
    leader = candidates[held.split("_")[0]]
    standby = next(p for p in candidates.values() if p is not leader)
    wait_for("the other to stand by", lambda: f"waiting to become leader; {held} holds the lease"
             in standby.log.read_text(), timeout=60, explain=lambda: logs(standby))
    assert leader.proc.poll() is None and standby.proc.poll() is None, logs(leader, standby)
    return leader, standby


def job_status(kube: Kubectl, name: str) -> dict:
    return (kube.get("trainingjob", name) or {}).get("status") or {}


def running_single_job(kube: Kubectl, leader) -> str:
    name = f"single-{uuid.uuid4().hex[:5]}"
    kube.apply({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
                "spec": {"mode": "Single"}}, server_side=True)
    wait_for(f"{name}-single-0 Running", lambda: (p := kube.get("pod", f"{name}-single-0"))
             and p["status"].get("phase") == "Running", timeout=90,
             explain=lambda: f"pod: {(kube.get('pod', f'{name}-single-0') or {}).get('status')}\n{logs(leader)}")
    wait_for(f"{name} Running", lambda: job_status(kube, name).get("state") == "Running", timeout=90,
             explain=lambda: logs(leader))
    return name


def snapshot(kube: Kubectl, job: str) -> dict:
    """What a takeover must leave as it was: every pod's uid and resourceVersion, the uids of the
    other children the job owns, the job's status and its Warning events."""
    pods = {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["resourceVersion"])
            for p in kube.items("pods", "-l", f"kubetrain.dev/job-name={job}")}
    uid = kube.get("trainingjob", job)["metadata"]["uid"]
    children = {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["uid"]
                for o in kube.items("configmaps,secrets,services,persistentvolumeclaims")
                if uid in [r["uid"] for r in o["metadata"].get("ownerReferences", [])]}
    warnings = sorted((e["reason"], e["message"]) for e in kube.events(job) if e["type"] == "Warning")
    return {"pods": pods, "children": children, "status": job_status(kube, job), "warnings": warnings}


def settled(kube: Kubectl, job: str, leader) -> dict:
    """snapshot() once two in a row, a second apart, are the same: the old leader's last writes
    (a status update just after Running) are not the new leader's doing."""
    last: dict = {}

    def unchanged() -> dict:
        nonlocal last
        now, previous = snapshot(kube, job), last
        last = now
        return now if now == previous else {}

    return wait_for(f"{job}'s objects to settle", unchanged, timeout=60, every=1.0, explain=lambda: logs(leader))


def reconciles(p) -> float:
    text = try_scrape(f"127.0.0.1:{p.metrics_port}")
    if text is None:
        return 0
    return samples(text).get(("kubetrain_operator_reconcile_duration_seconds_count", frozenset()), 0)


def test_the_standby_takes_over_from_a_killed_leader_and_changes_nothing(spawn_operator, cluster, namespace):
    kube = cluster.kube(namespace, timeout=60)
    leader, standby = leader_and_standby(spawn_operator, kube, namespace)
    wait_for("the leader's gauge at 1", lambda: gauge(leader, "kubetrain_operator_leader") == 1, timeout=30)
    assert gauge(standby, "kubetrain_operator_leader") == 0
    # A standby is healthy, just waiting: its liveness probe passes though kopf is not running.
    assert healthz(standby) == {"leader": False, "holder": holder(kube)}

    job = running_single_job(kube, leader)
    before = settled(kube, job, leader)
    assert before["pods"] and {k.split("/")[0] for k in before["children"]} >= {
        "ConfigMap", "Secret", "PersistentVolumeClaim"}, before
    transitions = kube.get("lease", LEASE)["spec"].get("leaseTransitions", 0)
    old = holder(kube)

    leader.signal(signal.SIGKILL)
    killed = time.monotonic()
    new = wait_for("the standby to take the lease", lambda: (h := holder(kube)) != old and h,
                   timeout=LEASE_SECONDS + RETRY_SECONDS + SLACK_SECONDS, every=0.2, explain=lambda: logs(standby))
    took = time.monotonic() - killed
    print(f"\ntakeover after SIGKILL of the leader: {took:.1f} s (lease {LEASE_SECONDS} s, retry {RETRY_SECONDS} s)")
    assert new.startswith("op-") and new.split("_")[0] != old.split("_")[0]
    assert kube.get("lease", LEASE)["spec"]["leaseTransitions"] == transitions + 1
    assert f"took over lease {namespace}/{LEASE} from {old}" in standby.log.read_text()

    wait_for("the new leader's first reconciliation", lambda: reconciles(standby) >= 1, timeout=60,
             explain=lambda: logs(standby))
    assert gauge(standby, "kubetrain_operator_leader") == 1  # set before kopf starts, so before any round
    # kopf's own liveness endpoint, on the port the standby's served while it waited.
    served = wait_for("kopf's /healthz", lambda: (h := healthz(standby)) is not None and {"body": h}, timeout=30)
    assert "leader" not in served["body"]
    # Two whole rounds of the new leader, the test's job among them (a running job with nothing new is
    # looked at again within MAX_REQUEUE_SECONDS): a wrong round (a pod deleted or recreated, a Warning, a
    # status rewritten) is done by then.
    wait_for("the new leader's second reconciliation", lambda: reconciles(standby) >= 2,
             timeout=MAX_REQUEUE_SECONDS + 30,
             explain=lambda: logs(standby))
    after = snapshot(kube, job)
    assert after["pods"] == before["pods"], "the new leader created, deleted or changed a pod that was right"
    assert after["children"] == before["children"]
    assert after["warnings"] == before["warnings"], "the takeover added Warning events"
    assert after["status"] == before["status"]
    assert standby.proc.poll() is None, logs(standby)


def test_a_leader_stopped_by_sigterm_releases_the_lease_for_an_immediate_takeover(spawn_operator, cluster, namespace):
    kube = cluster.kube(namespace, timeout=60)
    leader, standby = leader_and_standby(spawn_operator, kube, namespace)
    old = holder(kube)
    # A standby stopped while it waits just goes, and touches nothing.
    third = spawn_operator(namespace, "--leader-elect", "--lease-namespace", namespace, env={"POD_NAME": "op-c"})
    wait_for("a third to stand by", lambda: "waiting to become leader" in third.log.read_text(), timeout=60,
             explain=lambda: logs(third))
    third.signal(signal.SIGTERM)
    assert third.proc.wait(timeout=30) == 0, logs(third)
    assert holder(kube) == old

    leader.signal(signal.SIGTERM)
    stopped = time.monotonic()
    new = wait_for("the standby to take the released lease", lambda: (h := holder(kube)) != old and h,
                   timeout=LEASE_SECONDS + RETRY_SECONDS + SLACK_SECONDS, every=0.2,
                   explain=lambda: logs(leader, standby))
    took = time.monotonic() - stopped
    print(f"\ntakeover after SIGTERM of the leader: {took:.1f} s (lease {LEASE_SECONDS} s)")
    assert new.split("_")[0] != old.split("_")[0]
    # Released, not expired: well under the lease's duration (the rest is kopf's own shutdown).
    assert took < LEASE_SECONDS / 2 + RETRY_SECONDS, logs(leader, standby)
    assert leader.proc.wait(timeout=30) == 0
    assert f"released lease {namespace}/{LEASE}" in leader.log.read_text()
    wait_for("the new leader to run", lambda: gauge(standby, "kubetrain_operator_leader") == 1, timeout=30)
