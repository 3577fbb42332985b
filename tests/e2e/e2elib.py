"""What the e2e tests share: the end-to-end cluster's names and the E2E handle the fixture yields."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from helpers.jsonl import json_objects
from helpers.kube import Cluster, Kubectl
from helpers.metrics import try_scrape
from helpers.recovery import (
    Breakdown, breakdown, handover_marks, json_stream, kind_of, operator_marks, trainer_marks, watch_marks,
    workers_back,
)
from kubetrain.engine.children import LABEL_JOB
from helpers.wait import wait_for
from kubetrain.drivers.cluster.observe import parse_metrics
from kubetrain.shared import __version__

E2E_CLUSTER = os.environ.get("KUBETRAIN_E2E_CLUSTER", "kt-e2e")
KEEP = os.environ.get("KUBETRAIN_E2E_KEEP") == "1"  # leave the cluster up, reuse it next time
REAL_NODE = "kt-real-0"
S3_SECRET = "kubetrain-s3"
"""The object-storage Secret the e2e fixture `e2e_s3` makes: the one hack/values-e2e.yaml's objectStorage.secrets lists."""
NODE_CGROUP = f"kt-{E2E_CLUSTER}"  # hack/realnode/node's cgroupRoot: the node's pods under it, in every hierarchy
REAL_NODE_SELECTOR = {"kubetrain/node": "real"}
NAMESPACE = "e2e"  # the release's and the jobs' (the operator watches only its own namespace)
EXAMPLES = Path(__file__).parents[2] / "examples"
HELPER_IMAGE = "localhost/kubetrain/busybox:static"  # made by hack/realnode/node
# The e2e namespace enforces Pod Security `restricted`: the tests' own helper pods comply too.
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
CACHE = Path(os.environ.get("KUBETRAIN_CACHE", Path.home() / ".cache" / "kubetrain"))
METRICS_PORT = 9090  # the examples' spec.metrics.port (the default)
# Epochs per example, the same with and without faults so that their accuracies
# compare. Digits trains in seconds at these sizes: enough epochs that a fault
# lands after the first checkpoint (step 50) and long before the end.
EPOCHS = {"single.yaml": 300, "parameter-server.yaml": 60, "ddp.yaml": 80}
CHIEF = {"single.yaml": "single-0", "parameter-server.yaml": "worker-0", "ddp.yaml": "ddp-0"}
# The replica that writes the job's checkpoints and its claim.
HOLDER = {"single.yaml": ("single-0", "{job}-ckpt-single-0"), "parameter-server.yaml": ("ps-0", "{job}-ckpt-ps-0"),
          "ddp.yaml": ("ddp-0", "data-{job}-ddp-0")}
# Where recovery() leaves what it read (the watch, the operator's and the job's pods' logs); unset: nowhere.
RECOVERY_DIR = os.environ.get("KUBETRAIN_E2E_RECOVERY_DIR", "")
FIGURES: list[str] = []  # timings and accuracies, printed at the end of the session (conftest.py)
FAULT_FREE: dict[str, float] = {}  # manifest -> final accuracy of its fault-free run in this session


@dataclass(frozen=True)
class E2E:
    """The running end-to-end cluster: a Cluster, the real node's pod range and its containerd."""

    cluster: Cluster
    pod_cidr: str
    containerd: str
    host_ip: str = ""
    """The host end of the real node's veth: what pods reach this machine's servers at (the S3 server)."""

    @property
    def kube(self) -> Kubectl:
        """kubectl in the release's namespace."""
        return self.cluster.kube(NAMESPACE)

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return self.kube(*args, timeout=timeout)

    def get(self, kind: str, name: str) -> dict:
        """The object; fails when it is not there."""
        return self.kube.json("get", kind, name)

    def wait(self, what: str, check, timeout: float, every: float = 1.0):
        """Polls check() until it returns something truthy; fails naming `what`, the last value, the cluster's state."""
        return wait_for(what, check, timeout, every, explain=self.diagnostics)

    def diagnostics(self, describe: bool = False) -> str:
        """What explains a stuck test: the namespace's pods and events, the operator's last log lines;
        with `describe`, the nodes and the pods described too (an operator that never became ready)."""
        parts = []
        for args in (("get", "pods,pvc,tj", "-o", "wide"),
                     ("get", "events", "--sort-by=.lastTimestamp"),
                     *((("get", "nodes", "-o", "wide"), ("describe", "pods")) if describe else ())):
            done = self.kube.run(*args, timeout=60, check=False)
            parts.append(done.stdout[-4000:] + done.stderr[-2000:])
        done = self.kube.run("logs", self.operator_pod(), "--tail=30", timeout=60, check=False)
        parts.append(done.stdout + done.stderr)
        return "\n".join(parts)

    def operator_pod(self) -> str:
        """The acting operator: with the chart's two replicas, the pod that holds the leader Lease
        (`kubectl logs deploy/kubetrain` may pick the standby)."""
        done = self.kube.run("get", "lease", "kubetrain-leader", "-o", "json", timeout=60, check=False)
        if done.returncode != 0:
            return "deploy/kubetrain"  # one replica: no election
        holder = (json.loads(done.stdout).get("spec") or {}).get("holderIdentity") or ""
        return f"pod/{holder.rsplit('_', 1)[0]}" if holder else "deploy/kubetrain"


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
    e2e.kube.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {
            "nodeSelector": dict(REAL_NODE_SELECTOR), "restartPolicy": "Never", "securityContext": RESTRICTED_POD,
            "containers": [{"name": "read", "image": HELPER_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "securityContext": RESTRICTED_CONTAINER, "command": ["/bin/sh", "-c", script],
                            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
        },
    })
    e2e.wait(f"pod {pod} to finish", lambda: e2e.get("pod", pod)["status"].get("phase") in ("Succeeded", "Failed"),
             timeout=120)
    out = e2e.kubectl("logs", pod)
    e2e.kubectl("delete", "pod", pod, "--wait=false")
    return out


def figure(line: str) -> None:
    """A measured figure for the session's summary (and the test's own output)."""
    FIGURES.append(line)
    print(line)


def apply(e2e, doc: dict) -> float:
    """kubectl apply the manifest; returns the monotonic time just before."""
    start = time.monotonic()
    e2e.kube.apply(doc)
    return start


def succeeded(e2e, name: str, timeout: float = 600) -> dict:
    return e2e.wait(f"{name} to succeed", lambda: (s := job_status(e2e, name)).get("state") == "Succeeded" and s,
                    timeout=timeout, every=1)


def samples(ip: str, port: int = METRICS_PORT) -> dict[str, float] | None:
    """A pod's /metrics, read from the host (which routes to the real node's pod range); None if it does not answer."""
    text = try_scrape(f"{ip}:{port}", timeout=2)
    return None if text is None else parse_metrics(text)


@dataclass(frozen=True)
class Seen:
    """A replica's pod seen training: when (monotonic), which pod (uid), what its /metrics said."""

    at: float
    uid: str
    metrics: dict[str, float]


def watch_metrics(e2e, pod: str, check, what: str, not_uid: str | None = None, timeout: float = 300) -> Seen:
    """Poll the /metrics of pod `pod` (a newer one than `not_uid`) every 0.2 s until check(metrics) holds."""
    deadline = time.monotonic() + timeout
    ip = uid = None
    last = None
    while time.monotonic() < deadline:
        if ip is None:
            found = e2e.kube.items("pods", "--field-selector", f"metadata.name={pod}")
            if found and found[0]["metadata"]["uid"] != not_uid and found[0]["status"].get("podIP") \
                    and found[0]["status"].get("phase") == "Running":
                ip, uid = found[0]["status"]["podIP"], found[0]["metadata"]["uid"]
            else:
                time.sleep(0.3)
                continue
        last = samples(ip)
        if last is not None and check(last):
            return Seen(time.monotonic(), uid, last)
        if last is None and e2e.kubectl("get", "pod", pod, "-o", "jsonpath={.metadata.uid}", timeout=30) != uid:
            ip = None  # replaced meanwhile
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {pod} {what}; last metrics: {last!r}\n"
                         f"{e2e.diagnostics()}")


def first_step(e2e, pod: str, not_uid: str | None = None, timeout: float = 300) -> Seen:
    """The moment the pod's trainer has finished a training step (kubetrain_steps_total > 0)."""
    return watch_metrics(e2e, pod, lambda m: m.get("kubetrain_steps_total", 0) > 0, "to finish a step",
                         not_uid, timeout)


def first_checkpoint(e2e, pod: str, timeout: float = 300) -> Seen:
    """The moment the pod's trainer has made a checkpoint durable (kubetrain_last_checkpoint_step > 0)."""
    return watch_metrics(e2e, pod, lambda m: m.get("kubetrain_last_checkpoint_step", 0) > 0,
                         "to write a checkpoint", None, timeout)


def events_of(e2e, claim: str, replica: str) -> list[dict]:
    """The replica's event log (run/metrics/<replica>.jsonl) on its claim."""
    return json_objects(read_claim(e2e, claim, f"cat /data/run/metrics/{replica}.jsonl"))


def warning_reasons(e2e, name: str) -> set[str]:
    return {e["reason"] for e in e2e.kube.events(name) if e["type"] == "Warning"}


# Script jobs (spec.script): examples/custom and its user image (examples/custom/Dockerfile).
CUSTOM = EXAMPLES / "custom"
CUSTOM_IMAGE = f"kubetrain/custom-example:{__version__}"  # what examples/custom/*.yaml name; hack/images build --examples


def on_real_node(doc: dict) -> dict:
    """The manifest with its pods sent to the real node (the fake nodes run no containers)."""
    doc["spec"].setdefault("podTemplate", {}).setdefault("spec", {})["nodeSelector"] = dict(REAL_NODE_SELECTOR)
    return doc


def script_example(name: str, args: list[str] | tuple[str, ...] = ()) -> dict:
    """An examples/custom manifest on the real node, `args` appended to spec.script.args (train.py's
    argparse takes the last of a repeated option, so they override the example's)."""
    doc = yaml.safe_load((CUSTOM / name).read_text())
    doc["spec"]["script"]["args"] = [*doc["spec"]["script"].get("args", []), *args]
    return on_real_node(doc)


def read_files(e2e, claim: str, paths: list[str]) -> dict[str, str]:
    """The text of files on the claim (paths relative to its root), read by one busybox pod; '' when missing.

    One pod per claim: read_claim's pod has a fixed name, and a second one
    applied while the first is still terminating would patch that one."""
    marker = "=====kubetrain-e2e-file====="
    script = "; ".join(f"echo {marker}; cat /data/{path} 2>/dev/null" for path in paths)
    parts = read_claim(e2e, claim, script).split(f"{marker}\n")[1:]
    assert len(parts) == len(paths), (claim, paths, parts)
    return dict(zip(paths, parts))


def processes(e2e, pod: str, name: str = "trainer") -> list[tuple[int, str]]:
    """(pid on the host, command line) of each process of the pod's container `name`, from the node's
    containerd; the host sees the node's processes (the node has a network namespace of its own only)."""
    statuses = e2e.get("pod", pod)["status"]["containerStatuses"]
    [container] = [s["containerID"].split("://", 1)[1] for s in statuses if s["name"] == name]
    listing = subprocess.run(["ctr", "--address", e2e.containerd, "-n", "k8s.io", "tasks", "ps", container],
                             check=True, capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in listing.splitlines()[1:]:  # PID  INFO
        pid = int(line.split()[0])
        try:
            found.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()))
        except OSError:
            continue  # ended meanwhile
    return found


def sigkill_process(e2e, pod: str, needle: str) -> int:
    """SIGKILL the one process of the pod's trainer container whose command line holds `needle`, from the
    host, and wait until it is gone (its sockets closed: what answers on its port afterwards is another
    process). Returns its pid."""
    matching = [(pid, cmd) for pid, cmd in processes(e2e, pod) if needle in cmd]
    assert len(matching) == 1, f"not one process with {needle!r} in {pod}: {processes(e2e, pod)}"
    pid = matching[0][0]
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie has closed its files
        except OSError:
            return True

    e2e.wait(f"pid {pid} ({needle} in {pod}) to end after SIGKILL", gone, timeout=30, every=0.05)
    return pid


def logs(e2e, pod: str) -> str:
    """The pod's trainer log, the previous container's first (a StatefulSet restarts even a finished one)."""
    out = []
    for previous in (True, False):
        done = e2e.kube.run("logs", pod, "-c", "trainer", *(["--previous"] if previous else []), timeout=60,
                            check=False)
        out.append(done.stdout if done.returncode == 0 else "")
    return "".join(out)


# Recovery in parts (helpers/recovery.py): the pods' watch, the operator's log, the replacement's log.


class PodWatch:
    """`kubectl get pod -w` of one pod name (every incarnation of it), each event timed as it
    arrives: started before a fault, read after the replacement's first step."""

    def __init__(self, e2e, pod: str):
        self.events: list[tuple[float, str, dict]] = []
        self._proc = subprocess.Popen(
            ["kubectl", "-n", NAMESPACE, "get", "pods", "--field-selector", f"metadata.name={pod}", "-w",
             "--output-watch-events", "-o", "json"],
            env=e2e.cluster.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._thread = threading.Thread(target=self._read, name=f"watch-{pod}", daemon=True)
        self._thread.start()
        # The watch is only there once kubectl has listed the pod (its first event): a fault made before
        # that (a CI run: ps-0 killed, deleted and made again within 0.24 s) left the old pod's end unseen.
        deadline = time.monotonic() + 30
        while not self.events and time.monotonic() < deadline and self._proc.poll() is None:
            time.sleep(0.02)

    def _read(self) -> None:
        pending = ""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            pending += line
            docs, pending = json_stream(pending)
            now = time.time()
            self.events += [(now, d.get("type", ""), d.get("object") or {}) for d in docs if isinstance(d, dict)]

    def stop(self) -> list[tuple[float, str, dict]]:
        """Ends the watch (again: nothing); the events it saw."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._thread.join(timeout=10)
        return list(self.events)


def standby_recovery(e2e, job: str, victim: str, standby: str, fault_at: float) -> Breakdown:
    """The break-down of a standby's taking over `victim`'s place (helpers/recovery.py, kind standby): ps-0's
    handover from its log, the standby's milestones from its; call it once the standby made a step."""
    ps0 = e2e.kube.run("logs", f"{job}-ps-0", "-c", "trainer", timeout=60, check=False).stdout
    log = e2e.kube.run("logs", f"{job}-{standby}", "-c", "trainer", timeout=60, check=False).stdout
    marks = {"fault": fault_at, **handover_marks(ps0, int(victim.rsplit("-", 1)[1]), fault_at), **trainer_marks(log)}
    if RECOVERY_DIR:
        out = Path(RECOVERY_DIR) / f"{job}-{standby}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "marks.json").write_text(json.dumps(marks, indent=1))
        (out / "ps-0.log").write_text(ps0)
        (out / f"{standby}.log").write_text(log)
    return breakdown("standby", marks)


def recovery(e2e, job: str, replica: str, fault_at: float, old_uid: str, watch: PodWatch) -> Breakdown:
    """The break-down of `replica`'s recovery from a fault at `fault_at` (unix s): call it once the
    replacement made its first step (its log holds every milestone by then)."""
    events = watch.stop()
    marks = {"fault": fault_at, **watch_marks(events, old_uid)}
    operator = e2e.kube.run("logs", e2e.operator_pod(), timeout=60, check=False).stdout
    marks.update(operator_marks(operator, NAMESPACE, job, replica, after=fault_at))
    pods = {p["metadata"]["name"] for p in e2e.kube.items("pods", "-l", f"{LABEL_JOB}={job}")}
    pod_logs = {p: e2e.kube.run("logs", p, "-c", "trainer", timeout=60, check=False).stdout for p in sorted(pods)}
    marks.update(trainer_marks(pod_logs.get(f"{job}-{replica}", "")))
    kind = kind_of(replica)
    if kind == "ps":  # a shard's first step waits for every worker to reach it again
        marks.update(workers_back([log for p, log in pod_logs.items() if p.startswith(f"{job}-worker-")],
                                  after=fault_at))
    if RECOVERY_DIR:  # what the break-down was read from, to look into by hand
        out = Path(RECOVERY_DIR) / f"{job}-{replica}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "marks.json").write_text(json.dumps(marks, indent=1))
        (out / "watch.jsonl").write_text("".join(json.dumps([t, k, o]) + "\n" for t, k, o in events))
        (out / "operator.log").write_text(operator)
        for name, log in pod_logs.items():
            (out / f"{name}.log").write_text(log)
    return breakdown(kind, marks)
