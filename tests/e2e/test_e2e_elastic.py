"""Elastic jobs in real pods: `kubectl scale trainingjob` through the scale subresource while the job
trains. A ParameterServer job goes 2 -> 3 -> 1 workers, a DDP job 2 -> 1 -> 2 nodes, and the same DDP
job with strategy FSDP on one ReadWriteMany claim 2 -> 1 -> 2 nodes (each restart loads the newest
sharded checkpoint, resharded to the new world size); each finishes
within 2 points of accuracy of the same manifest run at a fixed size (locally: the same code and data,
as test_e2e_local_vs_cluster shows), with no restart counted."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from e2elib import apply, example, figure, job_status, read_files, succeeded, watch_metrics

from helpers.jsonl import json_objects

from support import kubetrain

pytestmark = pytest.mark.e2e

RESIZE_TIMEOUT_SECONDS = 240


def fixed_size_accuracy(tmp_path, doc: dict) -> float:
    """The manifest at its starting size, run on this machine."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{doc['metadata']['name']}-fixed.yaml"
    path.write_text(yaml.safe_dump(doc))
    run = tmp_path / "fixed"
    out = kubetrain("run", str(path), "--run-dir", str(run), "--quiet", timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads((run / "summary.json").read_text())["eval_accuracy"]


def reasons(e2e, name: str) -> list[str]:
    return [e["reason"] for e in e2e.kube.events(name)]


def scale_when(e2e, name: str, chief: str, at_step: int, size: int, pods: list[str]) -> tuple[float, int, float]:
    """`kubectl scale` once the chief's own /metrics (read every 0.2 s: the status is written every few
    seconds, and these jobs run tens of steps a second) passed `at_step`; waits until the job runs at
    `size` with `pods` Running. Returns the seconds from the scale to the new set's pods all Running,
    the chief's step once its new pod has stepped, and (ParameterServer: live) the seconds from the scale
    to ps-0's cut, read from ps-0's own /metrics (kubetrain_ps_workers: the kubelet refreshed its job file,
    ps-0 read it and dealt the epoch again), else 0."""
    watch_metrics(e2e, chief, lambda m: m.get("kubetrain_training_step", 0) >= at_step, f"to pass step {at_step}",
                  timeout=600)
    assert job_status(e2e, name).get("state") != "Succeeded", f"{name} finished before its resize to {size}"
    start = time.monotonic()
    e2e.kubectl("scale", "trainingjob", name, "--replicas", str(size))
    cut = 0.0
    if name == "elastic-ps":
        seen = watch_metrics(e2e, f"{name}-ps-0", lambda m: m.get("kubetrain_ps_workers") == size,
                             f"to serve {size} workers", timeout=RESIZE_TIMEOUT_SECONDS)
        cut = seen.at - start

    def resized() -> bool:
        status = job_status(e2e, name)
        assert status.get("state") != "Succeeded", f"{name} finished during its resize to {size}: {status}"
        if status.get("replicas") != size:
            return False
        running = {p["metadata"]["name"] for p in e2e.kube.items("pods", "-l", f"kubetrain.dev/job-name={name}")
                   if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
        return set(pods) <= running

    e2e.wait(f"{name} to run at {size}", resized, timeout=RESIZE_TIMEOUT_SECONDS, every=0.5)
    took = time.monotonic() - start
    stepped = watch_metrics(e2e, chief, lambda m: m.get("kubetrain_steps_total", 0) > 0, "to step at the new size",
                            timeout=RESIZE_TIMEOUT_SECONDS)
    return took, int(stepped.metrics["kubetrain_training_step"]), cut


FIRST_RESIZE_STEP = 100
STEPS_BETWEEN_RESIZES = 40  # counted from the chief's step once its new pod stepped: the job is mid-run
CASES = {
    # name: (manifest, resizes: (to size, the pods of the new set))
    "elastic-ps": ("quickstart.yaml", [(3, ["ps-0", "worker-0", "worker-1", "worker-2"]), (1, ["ps-0", "worker-0"])]),
    "elastic-ddp": ("ddp.yaml", [(1, ["ddp-0"]), (2, ["ddp-0", "ddp-1"])]),
    "elastic-fsdp": ("ddp.yaml", [(1, ["ddp-0"]), (2, ["ddp-0", "ddp-1"])]),
}
EPOCHS = 40  # 920 steps at 2 replicas (digits, batch 32): hundreds left at every resize


def scaled_twice(e2e, name: str) -> str:
    _, sizes = CASES[name]
    chief = f"{name}-worker-0" if name == "elastic-ps" else f"{name}-ddp-0"
    took, cuts, at = [], [], FIRST_RESIZE_STEP
    for size, pods in sizes:
        seconds, step, cut = scale_when(e2e, name, chief, at, size, [f"{name}-{p}" for p in pods])
        took.append(seconds)
        cuts.append(cut)
        at = step + STEPS_BETWEEN_RESIZES
    status = succeeded(e2e, name, timeout=900)
    assert status.get("restarts", 0) == 0, status
    assert status["replicas"] == sizes[-1][0]
    seen = reasons(e2e, name)
    # A ParameterServer job resizes live (no Resizing phase: nothing stops); a DDP group stops and starts again.
    assert seen.count("Resizing") == (0 if name == "elastic-ps" else 2) and seen.count("Resized") == 2, seen
    scale = json.loads(e2e.kubectl("get", "trainingjob", name, "--subresource=scale", "-o", "json"))
    assert scale["spec"]["replicas"] == sizes[-1][0] and scale["status"]["replicas"] == sizes[-1][0], scale
    if name == "elastic-ps":
        # Live: the shards and the chief ran through both resizes (one pod each, never replaced).
        for pod in ("ps-0", "worker-0"):
            starts = e2e.kubectl("get", "pod", f"{name}-{pod}", "-o", "jsonpath={.status.containerStatuses[0].restartCount}")
            assert starts == "0", (pod, starts)
        live = f", kubectl scale to ps-0's cut {cuts[0]:.1f} s / {cuts[1]:.1f} s"
    else:
        live = ""
    if name == "elastic-fsdp":
        # Every start after the first loaded the sharded checkpoint the resize's stop had just written.
        events = json_objects(read_files(e2e, f"{name}-ckpt-ddp", ["run/metrics/ddp-0.jsonl"])["run/metrics/ddp-0.jsonl"])
        stops = [e["step"] for e in events if e["event"] == "stop"]
        resumes = [e for e in events if e["event"] == "resume"]
        assert len(stops) == 2 and [e["step"] for e in resumes] == stops, (stops, resumes)
        assert all(e.get("sharded") for e in resumes), resumes
        live = f", resumed from sharded checkpoints at steps {stops}"
    return (f"sizes 2 -> {sizes[0][0]} -> {sizes[1][0]}, each resize (kubectl scale to the new set Running) "
            f"{took[0]:.1f} s / {took[1]:.1f} s{live}")


def test_jobs_scaled_twice_in_real_pods_finish_within_two_points_of_a_fixed_size_run(e2e, tmp_path):
    """Both jobs at once (the real node has room for both), each driven by its own thread; the fixed-size
    baselines run on this machine meanwhile."""
    docs = {}
    for name, (manifest, _) in CASES.items():
        doc = example(manifest, EPOCHS)
        doc["metadata"]["name"] = name
        if name in ("elastic-ddp", "elastic-fsdp"):
            doc["spec"]["ddp"].update(minNodes=1, maxNodes=2)
        if name == "elastic-fsdp":
            doc["spec"]["ddp"]["strategy"] = "FSDP"
            doc["spec"]["checkpoint"]["storage"] = {"accessMode": "ReadWriteMany",
                                                    "storageClassName": "local-path-shared"}
        docs[name] = doc
        apply(e2e, doc)
    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        runs = {name: pool.submit(scaled_twice, e2e, name) for name in CASES}
        baselines = {name: fixed_size_accuracy(tmp_path / name, doc) for name, doc in docs.items()}
        done = {name: run.result() for name, run in runs.items()}
    for name in CASES:
        accuracy = job_status(e2e, name)["progress"]["evalAccuracy"]
        assert abs(accuracy - baselines[name]) <= 0.02, (name, accuracy, baselines[name])
        figure(f"{name}: {done[name]} in real pods; accuracy {accuracy:.4f}, the same job at a fixed size "
               f"{baselines[name]:.4f}; restarts 0")
