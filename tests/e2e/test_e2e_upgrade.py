"""`helm upgrade` and `helm rollback` with jobs running, in real pods (docs/operating.md#upgrades).

The previous release (hack/releases; its images and chart built once by `hack/release build`, cached outside
the clone) is installed as a release of its own, `kubetrain-upgrade`, in a namespace of its own, `e2e-upgrade`,
beside the session's chart (whose operator watches only its namespace, `e2e`): the two never touch each
other's jobs. The cluster's CRD is the previous release's while that release alone is installed (`kubectl
replace`), as on a cluster that ran it.

Upgrade: a ParameterServer, a DDP, a fault-tolerant DDP and an FSDP job train under the previous release;
the CRD step (`kubectl apply --server-side --force-conflicts -f charts/kubetrain/crds/`) and `helm upgrade` to
this tree's chart and images run while they train. Then: no job pod's uid or restart count changed; the
operator's Deployment rolled over to this release's image, and its new leader drove every job while it still
trained (each job's status.trainer, which only this release writes, recorded the previous trainer); a job
submitted now keeps a field new in this release (before the CRD step the API server pruned it); every job
ends with the result of the same job run without an upgrade.

Rollback: the same four jobs start under this release, `helm rollback` returns the operator to the previous
release while they train, with the same checks (the CRD stays this release's: Helm leaves crds/ alone).

"The same job without an upgrade" is the same manifest run meanwhile in the session's namespace under the
session's operator, which is never upgraded, with the trainer the upgraded job runs (the previous release's
for the upgrade, this one's for the rollback): each mode trains deterministically here, so the final step,
loss, evaluation loss and accuracy must be equal, to the last bit. The jobs are small (digits, an MLP) and
their pods few (2 + 2 + 3 + 1), since the real node has 2 cores and both sets train at once.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime

import pytest
import yaml
from e2elib import CACHE, example, figure
from support import ROOT, kubetrain

from kubetrain.shared import __version__
from kubetrain.api import versions
from kubetrain.engine.children import LABEL_JOB

pytestmark = pytest.mark.e2e

UPGRADE_NAMESPACE = "e2e-upgrade"
RELEASE = "kubetrain-upgrade"  # the chart's full name too (it contains the chart's name)
CHART = ROOT / "charts" / "kubetrain"
CRDS = CHART / "crds"
PREVIOUS, PREVIOUS_COMMIT = subprocess.run([str(ROOT / "hack" / "release"), "previous"], capture_output=True,
                                           text=True, check=True).stdout.split()
PREVIOUS_SRC = CACHE / "releases" / PREVIOUS / "src"
PREVIOUS_TRAINER = f"kubetrain/trainer:{PREVIOUS}"
SHARED_CLASS = "local-path-shared"  # the real node's ReadWriteMany class, for the FSDP job's one claim
RESULT = ("step", "loss", "evalLoss", "evalAccuracy")  # status.progress at success: the chief's final results
# Epochs of each job: long enough that every job still trains when the upgraded operator has taken over
# (the slowest one's start, the upgrade and the new leader's first round), short enough for the lane.
EPOCHS = {"ps": 140, "ddp": 130, "ft": 70, "fsdp": 26}
NEW_FIELD = ("model", "diskSize", "2Gi")  # a spec field new in this release (it is not in PREVIOUS's CRD)


def four_jobs(prefix: str) -> dict[str, dict]:
    """The four jobs, by kind: the examples', smaller, their pods on the real node."""
    ps = example("parameter-server.yaml", EPOCHS["ps"])
    ps["spec"]["parameterServer"]["workers"] = 1
    ddp = example("ddp.yaml", EPOCHS["ddp"])
    ft = example("ddp-fault-tolerant.yaml", EPOCHS["ft"])
    ft["spec"]["ddp"].update(nodes=2)
    for key in ("minNodes", "maxNodes"):
        ft["spec"]["ddp"].pop(key)
    # Loaded pods start seconds apart and may miss a heartbeat: a group left out of a step would change the
    # numbers (the data follows the quorum), and these must match the run without an upgrade exactly.
    ft["spec"]["ddp"]["faultTolerance"].update(heartbeatTimeoutSeconds=10, joinTimeoutSeconds=300,
                                               quorumTimeoutSeconds=600)
    fsdp = example("ddp.yaml", EPOCHS["fsdp"])
    fsdp["spec"]["ddp"].update(nodes=1, procsPerNode=2, strategy="FSDP")
    fsdp["spec"]["checkpoint"]["storage"] = {"accessMode": "ReadWriteMany", "storageClassName": SHARED_CLASS}
    jobs = {"ps": ps, "ddp": ddp, "ft": ft, "fsdp": fsdp}
    for kind, doc in jobs.items():
        doc["metadata"] = {"name": f"{prefix}-{kind}"}
    return jobs


@dataclass(frozen=True)
class Install:
    """The release under test: its namespace and the e2e cluster."""

    e2e: object

    @property
    def kube(self):
        return self.e2e.cluster.kube(UPGRADE_NAMESPACE)

    def run(self, *args: str, input: str | None = None, timeout: float = 400) -> str:
        return self.e2e.cluster.run(*args, input=input, timeout=timeout)

    def helm(self, *args: str, timeout: float = 400) -> str:
        return self.run("helm", *args, "--namespace", UPGRADE_NAMESPACE, timeout=timeout)

    def revision(self) -> tuple[int, str]:
        """(revision, app version) of the release."""
        [entry] = json.loads(self.helm("list", "--filter", f"^{RELEASE}$", "-o", "json"))
        return int(entry["revision"]), entry["app_version"]

    def values(self) -> list[str]:
        """This tree's chart values for the e2e node (hack/values-e2e.yaml, as the session's install)."""
        return ["-f", str(ROOT / "hack" / "values-e2e.yaml"), "--set",
                f"operator.scrapeNetworks={{{self.e2e.pod_cidr}}}"]

    def upgrade(self) -> float:
        """The documented upgrade: this release's CRD, then its chart and images; seconds it took."""
        started = time.monotonic()
        self.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
        self.helm("upgrade", RELEASE, str(CHART), *self.values(), "--wait", "--timeout", "5m")
        return time.monotonic() - started


@pytest.fixture(scope="module")
def install(e2e):
    """The previous release, installed alone in its namespace with its CRD, its images in the node's containerd."""
    env = e2e.cluster.env
    built = subprocess.run([str(ROOT / "hack" / "release"), "check", PREVIOUS], capture_output=True, text=True,
                           env=env, timeout=120)
    if built.returncode != 0:
        pytest.fail(f"{built.stderr.strip()} (hack/test's set-up builds it)", pytrace=False)
    started = time.monotonic()
    load = subprocess.run([str(ROOT / "hack" / "release"), "load", PREVIOUS], capture_output=True, text=True,
                          env={**env, "CONTAINERD_ADDRESS": e2e.containerd}, timeout=900)
    assert load.returncode == 0, f"hack/release load {PREVIOUS} failed:\n{load.stderr[-4000:]}"
    loaded = time.monotonic() - started
    up = Install(e2e)
    up.run("kubectl", "apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": UPGRADE_NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}))
    try:
        # The cluster as the previous release left it: its CRD, whole. A replace (a PUT at the CRD's current
        # resourceVersion), not an apply: an apply would keep the fields that this release's CRD has, the
        # previous one lacks and another field manager (the session's helm install) owns.
        old = yaml.safe_load((PREVIOUS_SRC / "charts" / "kubetrain" / "crds" / "trainingjobs.yaml").read_text())
        current = json.loads(up.run("kubectl", "get", "crd", old["metadata"]["name"], "-o", "json"))
        old["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        up.run("kubectl", "replace", "-f", "-", input=json.dumps(old))
        started = time.monotonic()
        up.helm("install", RELEASE, str(PREVIOUS_SRC / "charts" / "kubetrain"), "--skip-crds",
                "-f", str(PREVIOUS_SRC / "hack" / "values-e2e.yaml"),
                "--set", f"operator.scrapeNetworks={{{e2e.pod_cidr}}}", "--wait", "--timeout", "5m")
        figure(f"upgrade: release {PREVIOUS} ({PREVIOUS_COMMIT[:12]}): images loaded in {loaded:.0f} s "
               f"({_loaded_how(load.stderr)}), its chart installed in {time.monotonic() - started:.0f} s")
        yield up
    finally:
        up.run("helm", "uninstall", RELEASE, "--namespace", UPGRADE_NAMESPACE, "--wait", timeout=300)
        up.run("kubectl", "delete", "namespace", UPGRADE_NAMESPACE, "--wait=false")
        # The session's other tests run on this release's CRD.
        up.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(CRDS))


def _loaded_how(stderr: str) -> str:
    lines = [line.removeprefix("hack/images: ") for line in stderr.splitlines() if " loaded in " in line
             or " is loaded" in line or "instead of the whole image" in line]
    return "; ".join(lines) or "nothing to load"


def pods_of(kube, jobs) -> dict[str, tuple[str, dict[str, int]]]:
    """Every pod of the jobs: name -> (uid, restart count by container)."""
    out = {}
    for name in jobs:
        for pod in kube.items("pods", "-l", f"{LABEL_JOB}={name}"):
            counts = {c["name"]: c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or []}
            out[pod["metadata"]["name"]] = (pod["metadata"]["uid"], counts)
    return out


def operator_pods(up: Install) -> list[dict]:
    return [p for p in up.kube.items("pods", "-l", "app.kubernetes.io/component=operator")
            if not p["metadata"].get("deletionTimestamp")]


def rolled_over(up: Install, version: str):
    """The operator's pods all run `version`'s image and one of them holds the lease: (its pod, since when)."""
    pods = operator_pods(up)
    want = f"kubetrain/operator:{version}"
    if not pods or any(c["image"] != want for p in pods for c in p["spec"]["containers"]):
        return None
    lease = up.kube.get("lease", f"{RELEASE}-leader")
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity") or ""
    leader = holder.rsplit("_", 1)[0]
    if leader not in {p["metadata"]["name"] for p in pods}:
        return None
    return leader, lease["spec"].get("acquireTime") or lease["spec"].get("renewTime")


def driven_since(up: Install, name: str, since: str, check_trainer: str | None) -> bool:
    """The job's status was written by the new leader (its progress updated after it took the lease; with
    `check_trainer`, status.trainer recorded as that image) while the job still trained."""
    status = up.kube.json("get", "trainingjob", name).get("status") or {}
    assert status.get("state") not in ("Succeeded", "Failed"), (
        f"{name} ended ({status.get('state')}) before the new operator drove it: its EPOCHS are too few for this "
        f"machine's speed: {json.dumps(status.get('progress'))}")
    if check_trainer is not None and (status.get("trainer") or {}).get("image") != check_trainer:
        return False
    updated = (status.get("progress") or {}).get("updateTime")
    return updated is not None and moment(updated) > moment(since)


def moment(text: str) -> datetime:
    """An RFC 3339 time of the API (a Lease's MicroTime, a status's seconds)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def submit(up: Install, jobs: dict[str, dict], image: str | None) -> tuple[dict[str, dict], dict[str, str]]:
    """The jobs in the upgrade's namespace, and each one's twin in the session's namespace (never upgraded),
    running `image`; returns (the jobs by name, each one's twin)."""
    twins = {}
    for doc in jobs.values():
        up.kube.apply(doc)
        twin = json.loads(json.dumps(doc))
        twin["metadata"]["name"] = f"{doc['metadata']['name']}-base"
        if image is not None:
            twin["spec"]["image"] = image
        up.e2e.kube.apply(twin)
        twins[doc["metadata"]["name"]] = twin["metadata"]["name"]
    return {d["metadata"]["name"]: d for d in jobs.values()}, twins


def training(up: Install, names) -> dict[str, int]:
    """Waits until every job has a step in its status; their steps."""
    def stepped() -> dict[str, int] | None:
        steps = {}
        for name in names:
            status = up.kube.json("get", "trainingjob", name).get("status") or {}
            assert status.get("state") not in ("Succeeded", "Failed"), f"{name} ended before the change: {status}"
            steps[name] = (status.get("progress") or {}).get("step") or 0
        return steps if all(steps.values()) else None

    return up.e2e.wait("every job to train", stepped, timeout=600, every=2)


def finished(kube, wait, name: str, timeout: float = 900) -> dict:
    def done():
        status = kube.json("get", "trainingjob", name).get("status") or {}
        assert status.get("state") != "Failed", f"{name} failed: {json.dumps(status, indent=1)}"
        return status if status.get("state") == "Succeeded" else None

    return wait(f"{name} to succeed", done, timeout=timeout, every=2)


def same_results(up: Install, jobs, twins) -> dict[str, dict]:
    """Each job's final results, which must be its twin's exactly; both end without a restart."""
    results = {}
    for name in jobs:
        status = finished(up.kube, up.e2e.wait, name)
        twin = finished(up.e2e.kube, up.e2e.wait, twins[name])
        mine = {k: (status.get("progress") or {}).get(k) for k in RESULT}
        theirs = {k: (twin.get("progress") or {}).get(k) for k in RESULT}
        assert mine == theirs, f"{name} ended unlike the same job without the change: {mine} != {theirs}"
        assert status.get("restarts", 0) == 0 and twin.get("restarts", 0) == 0, (status, twin)
        results[name] = mine
    return results


def unchanged(before: dict, after: dict) -> None:
    """No pod of the jobs was replaced or restarted in between."""
    assert set(after) == set(before), f"pods came or went: before {sorted(before)}, after {sorted(after)}"
    changed = {pod: (before[pod], after[pod]) for pod in before if before[pod] != after[pod]}
    assert not changed, f"pods replaced or restarted by the change: {changed}"


def delete_jobs(up: Install, jobs, twins) -> None:
    for name in jobs:
        up.kube.run("delete", "trainingjob", name, "--wait=false", check=False)
        up.e2e.kube.run("delete", "trainingjob", twins[name], "--wait=false", check=False)


def version_lines(up: Install, job: str) -> list[str]:
    """`kubetrain version` of this release's client, for a job of the upgrade's namespace."""
    done = kubetrain("version", "--operator-namespace", UPGRADE_NAMESPACE, "--job", job, "-n", UPGRADE_NAMESPACE,
                     env={"KUBECONFIG": str(up.e2e.cluster.kubeconfig)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def skew_warnings(kube, names) -> list[dict]:
    return [e for name in names for e in kube.events(name) if e.get("reason") == versions.SKEW_REASON]


def test_helm_upgrade_with_four_jobs_running(install):
    up = install
    assert up.revision() == (1, PREVIOUS), "the previous release is installed, alone"
    started = time.monotonic()
    jobs, twins = submit(up, four_jobs("up"), PREVIOUS_TRAINER)
    try:
        # The previous release's CRD does not know this release's fields: kubectl's strict validation refuses
        # them, a client without it sees them pruned. What the CRD step is for.
        probe = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "new-field"},
                 "spec": {"mode": "Single", "model": {"name": "mlp", NEW_FIELD[1]: NEW_FIELD[2]},
                          "dataset": {"name": "digits"}, "training": {"epochs": 1}, "runPolicy": {"suspend": True}}}
        refused = up.kube.run("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        assert refused.returncode != 0 and f'unknown field "spec.model.{NEW_FIELD[1]}"' in refused.stderr, refused
        pruned = json.loads(up.kube.run("create", "--dry-run=server", "--validate=false", "-o", "json", "-f", "-",
                                        input=json.dumps(probe)).stdout)
        assert NEW_FIELD[1] not in pruned["spec"]["model"], pruned["spec"]

        steps = training(up, jobs)
        before = pods_of(up.kube, jobs)
        old_operators = {p["metadata"]["name"] for p in operator_pods(up)}
        took = up.upgrade()
        leader, since = up.e2e.wait(f"the operator to roll over to {__version__}", lambda: rolled_over(up, __version__),
                                    timeout=300)
        assert leader not in old_operators and not old_operators & {p["metadata"]["name"] for p in operator_pods(up)}
        assert up.revision() == (2, __version__)
        for name in jobs:  # the new leader drove each job while it trained, and recorded its trainer
            up.e2e.wait(f"the new operator to drive {name}", lambda name=name: driven_since(up, name, since,
                                                                                              PREVIOUS_TRAINER),
                        timeout=180, every=2)
        unchanged(before, pods_of(up.kube, jobs))
        handed = time.monotonic() - started
        said = version_lines(up, "up-ps")
        assert said[1].startswith(f"operator: kubetrain {__version__} ") and f"crd:      kubetrain {__version__} " in said[2]
        assert said[3] == f"trainer:  kubetrain {PREVIOUS} ({UPGRADE_NAMESPACE}/up-ps: {PREVIOUS_TRAINER})", said
        assert not [line for line in said if line.startswith("warning:")], said  # n-1: supported

        # A job submitted now keeps a field new in this release.
        up.kube.run("apply", "-f", "-", input=json.dumps(probe))
        kept = up.kube.json("get", "trainingjob", "new-field")["spec"]["model"]
        up.kube.run("delete", "trainingjob", "new-field", "--wait=false")
        assert kept.get(NEW_FIELD[1]) == NEW_FIELD[2], kept
        for name in jobs:  # and no stored job gained it: a new field has no CRD default (tests/api/test_crd_compat.py)
            assert NEW_FIELD[1] not in up.kube.json("get", "trainingjob", name)["spec"]["model"]

        results = same_results(up, jobs, twins)
        for name in jobs:
            assert up.kube.json("get", "trainingjob", name)["status"]["trainer"] == {
                "image": PREVIOUS_TRAINER, "version": PREVIOUS}
        assert not skew_warnings(up.kube, jobs), "n-1 is supported"
        figure(f"helm upgrade {PREVIOUS} -> {__version__} with 4 jobs training (steps then {steps}): the CRD step and "
               f"helm upgrade --wait {took:.0f} s; the new leader {leader} drove every job "
               f"{handed:.0f} s after the jobs were submitted; no pod restarted; results as without the upgrade "
               f"after {time.monotonic() - started:.0f} s: {results}")
    finally:
        delete_jobs(up, jobs, twins)


def test_helm_rollback_with_four_jobs_running(install):
    up = install
    revision, version = up.revision()
    if version != __version__:  # the upgrade test did not run first (deselected, or failed before its upgrade)
        up.upgrade()
        revision, version = up.revision()
    assert version == __version__
    up.e2e.wait(f"the operator at {__version__}", lambda: rolled_over(up, __version__), timeout=300)
    started = time.monotonic()
    jobs, twins = submit(up, four_jobs("down"), None)
    try:
        steps = training(up, jobs)
        before = pods_of(up.kube, jobs)
        for name in jobs:
            assert up.kube.json("get", "trainingjob", name)["status"]["trainer"]["version"] == __version__
        rolling = time.monotonic()
        up.helm("rollback", RELEASE, "--wait", "--timeout", "5m")
        took = time.monotonic() - rolling
        assert up.revision() == (revision + 1, PREVIOUS)
        leader, since = up.e2e.wait(f"the operator to roll back to {PREVIOUS}", lambda: rolled_over(up, PREVIOUS),
                                    timeout=300)
        for name in jobs:  # the older leader drives each job while it trains (it does not know status.trainer)
            up.e2e.wait(f"the rolled-back operator to drive {name}",
                        lambda name=name: driven_since(up, name, since, None), timeout=180, every=2)
        unchanged(before, pods_of(up.kube, jobs))
        said = version_lines(up, "down-ps")  # the older operator beside a job of the newer trainer: said so
        assert said[1].startswith(f"operator: kubetrain {PREVIOUS} ") and said[3].startswith(
            f"trainer:  kubetrain {__version__} "), said
        assert any(line.startswith("warning: The job's trainer is kubetrain") and "rollback" in line
                   for line in said), said
        results = same_results(up, jobs, twins)
        # Helm left the CRD at this release's: the record the older operator does not know stays.
        crd = json.loads(up.run("kubectl", "get", "crd", "trainingjobs.kubetrain.dev", "-o", "json"))
        assert crd["metadata"]["annotations"][versions.VERSION_ANNOTATION] == __version__
        for name in jobs:
            assert up.kube.json("get", "trainingjob", name)["status"]["trainer"]["version"] == __version__
        figure(f"helm rollback {__version__} -> {PREVIOUS} with 4 jobs training (steps then {steps}): "
               f"helm rollback --wait {took:.0f} s, leader {leader}; no pod restarted; results as without the "
               f"rollback after {time.monotonic() - started:.0f} s: {results}")
    finally:
        delete_jobs(up, jobs, twins)
