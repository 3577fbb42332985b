"""What the e2e tests share: the end-to-end cluster's names and the E2E handle the fixture yields."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from clusterlib import Cluster

E2E_CLUSTER = "kt-e2e"
REAL_NODE = "kt-real-0"
REAL_NODE_SELECTOR = {"kubetrain/node": "real"}
NAMESPACE = "e2e"  # the release's and the jobs' (the operator watches only its own namespace)
EXAMPLES = Path(__file__).parents[2] / "examples"
HELPER_IMAGE = "localhost/kubetrain/busybox:static"  # made by hack/realnode/node
CACHE = Path(os.environ.get("KUBETRAIN_CACHE", Path.home() / ".cache" / "kubetrain"))


@dataclass(frozen=True)
class E2E:
    """The running end-to-end cluster: a Cluster, the real node's pod range and its containerd."""

    cluster: Cluster
    pod_cidr: str
    containerd: str

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return self.cluster.kubectl("-n", NAMESPACE, *args, timeout=timeout)

    def get(self, kind: str, name: str) -> dict:
        return json.loads(self.kubectl("get", kind, name, "-o", "json"))

    def wait(self, what: str, check, timeout: float, every: float = 1.0):
        """Polls check() until it returns something truthy; fails naming `what` and the last value."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        """What explains a stuck test: the namespace's pods and events, the operator's last log lines."""
        parts = []
        for args in (("get", "pods,pvc,tj", "-o", "wide"),
                     ("get", "events", "--sort-by=.lastTimestamp")):
            done = subprocess.run(["kubectl", "-n", NAMESPACE, *args], env=self.cluster.env,
                                  capture_output=True, text=True, timeout=60)
            parts.append(done.stdout[-4000:] + done.stderr[-2000:])
        done = subprocess.run(["kubectl", "-n", NAMESPACE, "logs", "deploy/kubetrain", "--tail=30"],
                              env=self.cluster.env, capture_output=True, text=True, timeout=60)
        parts.append(done.stdout + done.stderr)
        return "\n".join(parts)


def leftovers() -> list[str]:
    """What of the real node is still there: its namespace, veth, run and state directories, mounts."""
    state = CACHE / "realnode" / E2E_CLUSTER
    run = Path("/run/kubetrain") / E2E_CLUSTER
    found = [str(p) for p in (Path("/run/netns") / f"kt-{E2E_CLUSTER}", run, state) if p.exists()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    veth = "kt-h" + hashlib.sha256(E2E_CLUSTER.encode()).hexdigest()[:6]  # hack/realnode/node's name
    found += [veth for line in links.splitlines() if f": {veth}" in line]
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    found += [m.split()[1] for m in mounts if m and m.split()[1].startswith((f"{state}/", f"{run}/"))]
    return found


def example(name: str, epochs: int) -> dict:
    """The example's manifest with `epochs`, its pods sent to the real node (the fake nodes run no containers)."""
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["spec"]["training"]["epochs"] = epochs
    doc["spec"].setdefault("podTemplate", {}).setdefault("spec", {})["nodeSelector"] = dict(REAL_NODE_SELECTOR)
    return doc


def json_objects(text: str) -> list[dict]:
    """The JSON objects written one after another in text."""
    decoder, objs, text = json.JSONDecoder(), [], text.strip()
    while text:
        obj, end = decoder.raw_decode(text)
        objs.append(obj)
        text = text[end:].strip()
    return objs


def job_status(e2e, name: str) -> dict:
    status = e2e.get("trainingjob", name).get("status") or {}
    failed = [c for c in status.get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
    assert not failed, f"{name} failed: {json.dumps(status, indent=1)}"
    return status


def stepped(e2e, name: str) -> dict | None:
    """The job's progress once it shows a step; fails when the job ended before the operator saw one."""
    status = job_status(e2e, name)
    progress = status.get("progress") or {}
    assert progress.get("step") or status.get("state") != "Succeeded", f"{name} succeeded before any progress: {status}"
    return progress if progress.get("step") else None


def read_claim(e2e, claim: str, script: str) -> str:
    """Runs `script` in a busybox pod on the real node with the claim mounted at /data; returns its output."""
    pod = f"read-{claim}"[:63]
    e2e.cluster.run("kubectl", "-n", NAMESPACE, "apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {
            "nodeSelector": dict(REAL_NODE_SELECTOR), "restartPolicy": "Never",
            "containers": [{"name": "read", "image": HELPER_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": ["/bin/sh", "-c", script],
                            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
        },
    }))
    e2e.wait(f"pod {pod} to finish", lambda: e2e.get("pod", pod)["status"].get("phase") in ("Succeeded", "Failed"),
             timeout=120)
    out = e2e.kubectl("logs", pod)
    e2e.kubectl("delete", "pod", pod, "--wait=false")
    return out
