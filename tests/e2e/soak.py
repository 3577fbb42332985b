"""The soak's driver (kubetrain/bench/soak.py holds the schedule and the figures): jobs of every kind on the e2e
cluster's real node, the seeded schedule's faults injected as they fall due, the jobs' statuses read
every POLL_SECONDS, and at the end what summarize() needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from e2elib import CACHE, E2E_CLUSTER, EXAMPLES, NAMESPACE, apply, example, on_real_node, processes
from test_e2e_faults import sigkill

from kubetrain.bench.soak import (
    QUIET_SECONDS, REPLICA_FAULTS, SMALL_VOLUME_MIB, STALL_SECONDS, VOLUME_FULL_SECONDS, Fault, Injected, JobRecord,
    schedule,
)

POLL_SECONDS = 2.0
MAX_JOBS_PER_KIND = 4
"""A kind whose job ended while faults still fall is started again, this many times at most."""
DRAIN_SECONDS = 600.0
"""After the last fault, how long the jobs have to end (six kinds at once on two cores)."""
RECOVERY_SECONDS = 600.0
"""A fault whose job (or, for the control plane's, any running job) shows no new step this long after it
is counted unrecovered."""
OPERATOR_LIMIT_MIB = 512.0  # the chart's operator memory limit


def job_doc(kind: str, n: int) -> dict:
    """A job of the kind, sized to train for several minutes beside the others on the real node's
    two cores (alone, each of the e2e tests' sizes ends in one or two), so that faults find it running."""
    if kind == "fsdp-script":
        doc = on_real_node(yaml.safe_load((EXAMPLES / "llm" / "fsdp-mlp.yaml").read_text()))
        args = doc["spec"]["script"]["args"]
        args[args.index("--steps") + 1] = "2000"
        # Its ranks share one claim: the real node's ReadWriteMany class (hack/realnode/node).
        doc["spec"]["checkpoint"]["storage"]["storageClassName"] = "local-path-shared"
    else:
        manifest, epochs = {"single": ("single.yaml", 10000), "ps": ("parameter-server.yaml", 400),
                            "ps-standby": ("parameter-server.yaml", 400), "ddp": ("ddp.yaml", 500),
                            "ft-ddp": ("ddp-fault-tolerant.yaml", 700)}[kind]
        doc = example(manifest, epochs)
        if kind == "ps-standby":
            doc["spec"]["parameterServer"]["standbyWorkers"] = 1
        if kind == "single":  # its checkpoints on a small volume of its own, which `volume-full` fills
            doc["spec"]["checkpoint"].setdefault("storage", {})["existingClaim"] = small_claim(kind, n)
    doc["metadata"]["name"] = f"soak-{kind}-{n}"
    # Faults come every MEAN_GAP_SECONDS; a job hit by many must not run out of restarts.
    doc["spec"].setdefault("restartPolicy", {})["backoffLimit"] = 50
    return doc


def small_claim(kind: str, n: int) -> str:
    return f"soakvol-{kind}-{n}"


class Soak:
    def __init__(self, e2e, seed: int, seconds: float):
        self.e2e, self.seed, self.seconds = e2e, seed, seconds
        self.faults = schedule(seed, seconds)
        self.jobs: dict[str, JobRecord] = {}
        self.started: dict[str, int] = {}
        self.statuses: dict[str, dict] = {}
        self.injected: list[Injected] = []
        self.last_hit: dict[str, float] = {}
        self.operator_peak_mib = 0.0
        self.failed_polls = 0  # polls the API server did not answer (its own restarts)
        self.supervisor: Supervisor | None = None
        self.volume_root = Path(tempfile.mkdtemp(prefix="kubetrain-soak-volumes-"))
        self.volumes: dict[str, Path] = {}  # claim -> its tmpfs on the host
        self.full: dict[str, tuple[Path, int, float, Injected]] = {}  # job -> (ballast, restarts before, until, fault)
        self.t0 = time.monotonic()

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> None:
        from kubetrain.bench.soak import JOB_KINDS

        for kind in JOB_KINDS:
            self._start(kind)
        pending = list(self.faults)
        while self._now() < self.seconds:
            self._poll()
            while pending and pending[0].at <= self._now():
                self._inject(pending.pop(0))
            self._release_volumes()
            for kind in JOB_KINDS:  # a kind whose job ended starts again while faults fall
                if all(self.statuses.get(j.name, {}).get("state") in ("Succeeded", "Failed")
                       for j in self.jobs.values() if j.kind == kind) and self.started[kind] < MAX_JOBS_PER_KIND:
                    self._start(kind)
            time.sleep(POLL_SECONDS)
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            self._poll()
            self._release_volumes()
            if all(s.get("state") in ("Succeeded", "Failed") for s in
                   (self.statuses.get(n, {}) for n in self.jobs)) and self._recoveries_settled():
                break
            time.sleep(POLL_SECONDS)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _start(self, kind: str) -> None:
        n = self.started.get(kind, 0)
        doc = job_doc(kind, n)
        try:
            claim = doc["spec"]["checkpoint"].get("storage", {}).get("existingClaim")
            if claim and claim not in self.volumes:
                self._small_volume(claim)
            apply(self.e2e, doc)
        except Exception:  # the API server restarting: the next loop tries again
            self.failed_polls += 1
            self.started.setdefault(kind, 0)
            return
        self.started[kind] = n + 1
        self.jobs[doc["metadata"]["name"]] = JobRecord(doc["metadata"]["name"], kind)

    def _poll(self) -> None:
        try:
            listed = self.e2e.kube.json("get", "trainingjobs", timeout=30)
        except Exception:  # the API server restarting (a fault of the soak's own): the next poll reads
            self.failed_polls += 1
            return
        now = self._now()
        for item in listed.get("items", []):
            name = item["metadata"]["name"]
            if name not in self.jobs:
                continue
            status = item.get("status") or {}
            self.statuses[name] = status
            record = self.jobs[name]
            record.state, record.restarts = status.get("state", ""), int(status.get("restarts") or 0)
            step = (status.get("lastCheckpoint") or {}).get("step")
            if step is not None and (not record.checkpoints or record.checkpoints[-1] != step):
                record.checkpoints.append(int(step))
        for fault in self.injected:
            if fault.skipped or fault.recovered_after is not None or not fault.steps:
                continue
            if fault.kind == "volume-full" and fault.job in self.full:
                continue  # measured from the volume's release: the job trains on until its checkpoint
            if all(((self.statuses.get(n, {}).get("progress") or {}).get("step") or 0) > step
                   or self.statuses.get(n, {}).get("state") in ("Succeeded", "Failed")
                   for n, step in fault.steps.items()):
                fault.recovered_after = round(now - fault.at - (fault.held_seconds or 0.0), 1)
        try:
            self._operator_memory()
        except Exception:
            self.failed_polls += 1

    def _recoveries_settled(self) -> bool:
        return all(f.skipped or f.recovered_after is not None or self._now() - f.at > RECOVERY_SECONDS
                   for f in self.injected)

    # -- faults ------------------------------------------------------------------------------------

    def _running_jobs(self, kinds: tuple[str, ...] | None = None) -> list[str]:
        """Jobs that run and train (a step read), not hit within QUIET_SECONDS, sorted by name."""
        now = self._now()
        return sorted(n for n, s in self.statuses.items()
                      if s.get("state") == "Running" and (s.get("progress") or {}).get("step")
                      and now - self.last_hit.get(n, -1e9) >= QUIET_SECONDS
                      and (kinds is None or self.jobs[n].kind in kinds))

    def _pods(self, job: str, prefix: str = "") -> list[str]:
        pods = self.e2e.kube.json("get", "pods", "-l", f"kubetrain.dev/job-name={job}")["items"]
        return sorted(p["metadata"]["name"] for p in pods
                      if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
                      and all(c.get("ready") or c.get("state", {}).get("running")
                              for c in p["status"].get("containerStatuses", []))
                      and p["metadata"]["name"].removeprefix(f"{job}-").startswith(prefix))

    def _inject(self, fault: Fault) -> None:
        record = Injected(at=round(self._now(), 1), kind=fault.kind)
        self.injected.append(record)
        self._inject_into(fault, record)
        # Progress on a run of many minutes (`kubetrain bench soak` runs the driver with pytest -s).
        what = f"skipped ({record.skipped})" if record.skipped else f"{record.target or record.job}"
        print(f"soak {record.at:7.1f} s: {record.kind}: {what}; {len(self.jobs)} jobs started", file=sys.stderr,
              flush=True)

    def _inject_into(self, fault: Fault, record: Injected) -> None:
        try:
            if fault.kind in ("operator", "apiserver"):
                # The control plane is quiet between its faults as a job is: faults that fell due while an
                # API server restarted (the loop waits for it) must not kill the next one as it comes up.
                if self._now() - self.last_hit.get("(control plane)", -1e9) < QUIET_SECONDS:
                    record.skipped = "the control plane was hit less than QUIET_SECONDS ago"
                    return
                self.last_hit["(control plane)"] = self._now()
                # Recovered when every job that trains has a new step in its status: the operator writes it.
                record.steps = {n: (self.statuses[n].get("progress") or {}).get("step") or 0
                                for n, s in self.statuses.items() if s.get("state") == "Running"
                                and (s.get("progress") or {}).get("step")}
                record.target = self._operator() if fault.kind == "operator" else self._apiserver()
                return
            kinds = {"lighthouse": ("ft-ddp",), "volume-full": ("single",)}.get(fault.kind)
            candidates = self._running_jobs(kinds)
            if not candidates:
                record.skipped = "no running job to hit"
                return
            job = candidates[int(fault.pick * len(candidates))]
            pods = self._pods(job, "lighthouse" if fault.kind == "lighthouse" else "")
            if fault.kind != "lighthouse":
                pods = [p for p in pods if "lighthouse" not in p]
            if fault.kind == "stall":
                pods = pods[:1]  # the chief (single-0, ps-0 before the workers: the first by name)
            if not pods:
                record.skipped = f"{job}: no running pod to hit"
                return
            pod = pods[int(fault.pick * 7919) % len(pods)]
            record.job, record.target = job, pod
            record.steps = {job: (self.statuses[job].get("progress") or {}).get("step") or 0}
            self.last_hit[job] = self._now()
            if fault.kind == "kill":
                sigkill(self.e2e, pod)
            elif fault.kind in ("delete", "lighthouse"):
                self.e2e.kubectl("delete", "pod", pod, "--wait=false")
            elif fault.kind == "stall":
                self._stall(pod)
            elif fault.kind == "volume-full":
                claim = self.e2e.get("trainingjob", job)["spec"]["checkpoint"]["storage"]["existingClaim"]
                record.target = claim
                self.full[job] = (self._fill(self.volumes[claim]), self.jobs[job].restarts,
                                  self._now() + VOLUME_FULL_SECONDS, record)
            if fault.kind in REPLICA_FAULTS:
                self.jobs[job].replica_faults += 1
        except Exception as err:  # a fault that could not be injected is reported, not fatal to the soak
            record.skipped = f"{type(err).__name__}: {err}"[:300]

    def _stall(self, pod: str) -> None:
        """SIGSTOP every process of the pod's trainer container for STALL_SECONDS, then SIGCONT."""
        pids = [pid for pid, _ in processes(self.e2e, pod)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

        threading.Timer(STALL_SECONDS, resume).start()

    def _small_volume(self, claim: str) -> None:
        """A tmpfs of SMALL_VOLUME_MIB on the host (the real node's kubelet shares its mounts), bound to the
        claim `claim` as a static PersistentVolume."""
        path = self.volume_root / claim
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_VOLUME_MIB}m,mode=1777", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=30)
        self.volumes[claim] = path
        size = f"{SMALL_VOLUME_MIB}Mi"
        self.e2e.kube.apply({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{NAMESPACE}-{claim}"},
            "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path), "type": "Directory"},
                     "claimRef": {"namespace": NAMESPACE, "name": claim}}})
        self.e2e.kube.apply({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"storageClassName": "", "volumeName": f"{NAMESPACE}-{claim}", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": size}}}})

    @staticmethod
    def _fill(path: Path) -> Path:
        """Write a ballast file until the volume has no byte left (smaller writes for the last ones)."""
        ballast = path / "soak-ballast"
        with open(ballast, "wb", buffering=0) as f:
            for size in (1 << 20, 1 << 16, 1 << 12, 1):
                block = b"\0" * size
                try:
                    while True:
                        f.write(block)
                except OSError:
                    continue
        return ballast

    def _release_volumes(self) -> None:
        """A full volume gets its room back once its job's restart shows (the checkpoint failed, the trainer
        exited), or VOLUME_FULL_SECONDS after the fault; the fault's recovery is measured from then."""
        for job, (ballast, before, until, fault) in list(self.full.items()):
            record = self.jobs[job]
            if record.restarts <= before and self._now() < until and record.state not in ("Succeeded", "Failed"):
                continue
            ballast.unlink(missing_ok=True)
            del self.full[job]
            fault.steps = {job: (self.statuses.get(job, {}).get("progress") or {}).get("step") or 0}
            fault.held_seconds = round(self._now() - fault.at, 1)

    def _operator(self) -> str:
        pod = self.e2e.operator_pod().removeprefix("pod/")
        self.e2e.kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return pod

    def _apiserver(self) -> str:
        """Kill the cluster's kube-apiserver and start it again with the same arguments, environment and
        directory. The scheduler and the controller manager exit when they lose their leader lease while
        it is down (as in any cluster, where the kubelet starts their static pods again): from the first
        such fault on, the supervisor starts any control-plane process that ended."""
        if self.supervisor is None:
            self.supervisor = Supervisor(CACHE / "kwok" / "clusters" / E2E_CLUSTER)
        restarted = self.supervisor.restart("kube-apiserver")
        ready = time.monotonic() + 120
        while time.monotonic() < ready:
            if self.e2e.kube.run("get", "--raw", "/readyz", timeout=10, check=False).returncode == 0:
                break
            time.sleep(0.5)
        return restarted

    def _operator_memory(self) -> None:
        """The operator pods' resident memory, from their containers' cgroups on the real node."""
        for pod in self.e2e.kube.json("get", "pods", "-l", "app.kubernetes.io/name=kubetrain")["items"]:
            statuses = pod["status"].get("containerStatuses") or []
            if not statuses or not statuses[0].get("containerID"):
                continue
            try:
                pid = processes(self.e2e, pod["metadata"]["name"], statuses[0]["name"])[0][0]
                text = Path(f"/proc/{pid}/status").read_text()
            except Exception:
                continue
            rss = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), 0) / 1024
            self.operator_peak_mib = max(self.operator_peak_mib, rss)

    # -- the end -----------------------------------------------------------------------------------

    def orphans(self) -> list[str]:
        """Delete every soak job and wait: what of theirs is left (pods, Services, ConfigMaps, Secrets,
        StatefulSets, claims not kept) is an orphan."""
        for name in self.jobs:
            self.e2e.kubectl("delete", "trainingjob", name, "--wait=false")
        left: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            left = []
            for kind in ("pods", "services", "configmaps", "secrets", "statefulsets", "pvc"):
                items = self.e2e.kube.json("get", kind)["items"]
                left += [f"{kind}/{i['metadata']['name']}" for i in items
                         if any(i["metadata"]["name"].startswith(f"{n}-") or i["metadata"]["name"].startswith(f"data-{n}-")
                                for n in self.jobs)]
            if not left:
                break
            time.sleep(2)
        return left

    def reasons(self) -> None:
        """The Events' reasons of each job whose restarts differ from its replica faults: what the figures
        name beside the broken invariant (read before orphans() deletes the jobs)."""
        for record in self.jobs.values():
            if record.restarts == record.replica_faults:
                continue
            try:
                events = self.e2e.kube.json("get", "events", "--field-selector", f"involvedObject.name={record.name}")
            except Exception:
                continue
            record.reasons = [f"{e.get('reason')} x{e.get('count') or 1}" for e in events.get("items", [])
                              if e.get("reason") not in ("Created", "Running", "Succeeded")]

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for claim, path in self.volumes.items():
            self.e2e.kube.run("delete", "pvc", claim, "--wait=false", check=False, timeout=60)
            self.e2e.kube.run("delete", "pv", f"{NAMESPACE}-{claim}", "--wait=false", check=False, timeout=60)
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)

    def write(self, result: dict, path: str | None) -> None:
        if path:
            Path(path).write_text(json.dumps(result, indent=2) + "\n")



class Supervisor:
    """What a cluster's kubelet does for its control plane's static pods, for kwokctl's processes: each
    component's command line, environment and directory read once, and a component that ended started
    again (its kwokctl pid file updated, so that `hack/cluster down` stops the new process)."""

    COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
    EVERY_SECONDS = 1.0

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.specs = {name: self._spec(name) for name in self.COMPONENTS}
        self.restarts: dict[str, int] = {name: 0 for name in self.COMPONENTS}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _pidfile(self, name: str) -> Path:
        return self.workdir / "pids" / f"{name}.pid"

    def _pid(self, name: str) -> int:
        return int(self._pidfile(name).read_text().strip())

    def _spec(self, name: str) -> tuple[list[str], dict[str, str], str]:
        proc = Path(f"/proc/{self._pid(name)}")
        argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        env = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        return argv, env, os.readlink(proc / "cwd")

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False

    def _start(self, name: str) -> int:
        argv, env, cwd = self.specs[name]
        with open(self.workdir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=log, start_new_session=True)
        self._pidfile(name).write_text(f"{proc.pid}\n")
        self.restarts[name] += 1
        threading.Thread(target=proc.wait, daemon=True).start()  # reaped when it ends
        return proc.pid

    def restart(self, name: str) -> str:
        with self._lock:
            pid = self._pid(name)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            for _ in range(300):
                if not self._alive(pid):
                    break
                time.sleep(0.1)
            return f"{name} (pid {pid} -> {self._start(name)})"

    def _watch(self) -> None:
        while not self._stop.wait(self.EVERY_SECONDS):
            with self._lock:
                for name in self.COMPONENTS:
                    try:
                        if not self._alive(self._pid(name)):
                            self._start(name)
                    except (OSError, ValueError):
                        continue

    def stop(self) -> None:
        self._stop.set()
