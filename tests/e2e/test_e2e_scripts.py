"""Script jobs (spec.script) for real: the user image of examples/custom/Dockerfile on the real node.

examples/custom/single.yaml and ddp.yaml run train.py from that image (built
FROM the trainer image and loaded once per session by the `custom_image`
fixture) in mode Single and in mode DDP with two ranks. train.py's batches
depend on the step and the rank alone, so a run resumed from one of its saves
ends with exactly the weights of a run that never stopped: its final
`kubetrain.report` (eval_loss, weight_norm) is compared for equality, not
within a tolerance. A third job mounts a dataset through spec.podTemplate and
reads it beside kubetrain's own mounts.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2elib import (
    REAL_NODE, Seen, apply, figure, first_checkpoint, first_step, logs, on_real_node,
    read_files, script_example, sigkill_process, succeeded, warning_reasons, watch_metrics,
)

from helpers.jsonl import json_objects

pytestmark = pytest.mark.e2e

MODES = ("single", "ddp")
MANIFESTS = {"single": "single.yaml", "ddp": "ddp.yaml"}
STEPS = 300  # the examples' --steps; saves every 50
# The examples' batch is 64: their 300 steps then take under a second once
# torch has loaded, too short for a fault to land between the first save (step
# 50) and the end. 8192 samples per step per rank make it about 10 s here
# (first save 1-2 s after the first step), the same for the fault-free runs,
# whose weights the faulted runs must match.
ARGS = ("--batch-size", "8192")
CHIEF = {"single": "single-0", "ddp": "ddp-0"}
# Where each replica keeps its run directory (run/results, run/metrics): Single its claim, DDP each pod its own.
CLAIMS = {"single": {"single-0": "{job}-ckpt-single-0"},
          "ddp": {"ddp-0": "data-{job}-ddp-0", "ddp-1": "data-{job}-ddp-1"}}
REPLICAS = {"single": {"single": 1}, "ddp": {"ddp": 2}}
VICTIM = {"single": "single-0", "ddp": "ddp-1"}  # whose train.py is SIGKILLed: the only process / rank 1
RESUMED = re.compile(r"rank (\d+): resumed from step (\d+)")
FAULT_FREE: dict[str, dict] = {}  # mode -> the chief's results of its fault-free run in this session


def job_name(doc: dict) -> str:
    return doc["metadata"]["name"]


def run_files(e2e, mode: str, job: str) -> dict[str, dict]:
    """replica -> {"results": its results (None if it wrote none), "events": its event log}, from the claims."""
    def read(replica: str) -> dict:
        files = read_files(e2e, CLAIMS[mode][replica].format(job=job),
                           [f"run/results/{replica}.json", f"run/metrics/{replica}.jsonl"])
        results, events = files.values()
        return {"results": json.loads(results) if results.strip() else None, "events": json_objects(events)}

    replicas = list(CLAIMS[mode])
    with ThreadPoolExecutor(len(replicas)) as pool:  # a busybox pod per claim, side by side
        return dict(zip(replicas, pool.map(read, replicas)))


def final_values(results: dict) -> dict[str, float]:
    """What train.py's last kubetrain.report carried, as the chief's results hold it."""
    return {"eval_loss": results["eval_loss"], "weight_norm": results["metrics"]["weight_norm"]}


def training(e2e, pod: str) -> tuple[Seen, Seen]:
    """The pod's first step on its /metrics, and a later read with a higher kubetrain_training_step."""
    first = first_step(e2e, pod)
    later = watch_metrics(e2e, pod, lambda m: m.get("kubetrain_training_step", 0) > first.metrics["kubetrain_training_step"],
                          "to report a later step", not_uid=None)
    return first, later


def run_fault_free(e2e, docs: dict[str, dict]) -> dict[str, dict]:
    """Apply the jobs at once (their pod starts overlap), check each as a fault-free run, keep its results.

    Returns each mode's final status."""
    started = {mode: apply(e2e, doc) for mode, doc in docs.items()}
    with ThreadPoolExecutor(len(docs)) as pool:
        seen = dict(zip(docs, pool.map(lambda m: training(e2e, f"{job_name(docs[m])}-{CHIEF[m]}"), docs)))
        statuses = dict(zip(docs, pool.map(lambda m: succeeded(e2e, job_name(docs[m])), docs)))
    for mode, doc in docs.items():
        job, status = job_name(doc), statuses[mode]
        first, later = seen[mode]
        pods = json.loads(e2e.kubectl("get", "pods", "-l", f"kubetrain.dev/job-name={job}", "-o", "json"))["items"]
        assert {p["spec"].get("nodeName") for p in pods} <= {REAL_NODE}, [p["spec"].get("nodeName") for p in pods]
        progress = status["progress"]
        assert progress["step"] == progress["totalSteps"] == STEPS, status
        assert status["lastCheckpoint"]["step"] == STEPS, status
        assert status.get("restarts", 0) == 0, status
        assert status["replicaStatuses"] == {role: {"active": 0, "succeeded": n, "failed": 0}
                                             for role, n in REPLICAS[mode].items()}, status
        # The chief's /metrics while it trained: the step moving on, the loss train.py reports every step.
        assert later.metrics["kubetrain_training_step"] > first.metrics["kubetrain_training_step"] > 0, (first, later)
        assert "kubetrain_loss" in first.metrics, first.metrics
        results = run_files(e2e, mode, job)[CHIEF[mode]]["results"]
        assert results and results["steps"] == STEPS and results["checkpoint_step"] == STEPS, results
        values = final_values(results)
        FAULT_FREE[mode] = results
        figure(f"{job}: kubectl apply -> first training step {first.at - started[mode]:.1f} s; "
               f"/metrics step {first.metrics['kubetrain_training_step']:.0f} -> {later.metrics['kubetrain_training_step']:.0f}; "
               f"Succeeded at step {progress['step']}; eval_loss {values['eval_loss']!r}, "
               f"weight_norm {values['weight_norm']!r}; status.progress.metrics {progress.get('metrics')}")
    return statuses


def test_script_examples_run_single_and_ddp_from_the_user_image_to_success(e2e, custom_image):
    statuses = run_fault_free(e2e, {mode: script_example(MANIFESTS[mode], ARGS) for mode in MODES})
    # The operator's status carries what the script reported last, as the chief's results say:
    # train.py reports weight_norm once, right before it exits.
    carried = {mode: (status["progress"].get("metrics") or {}).get("weight_norm") for mode, status in statuses.items()}
    assert carried == {mode: FAULT_FREE[mode]["metrics"]["weight_norm"] for mode in MODES}, statuses


def fault_free(e2e) -> dict[str, dict[str, float]]:
    """Each mode's fault-free final values: from the test above in this session, else run now."""
    missing = {}
    for mode in MODES:
        if mode not in FAULT_FREE:
            doc = script_example(MANIFESTS[mode], ARGS)
            doc["metadata"]["name"] = f"ref-{job_name(doc)}"
            missing[mode] = doc
    if missing:
        run_fault_free(e2e, missing)
    return {mode: final_values(FAULT_FREE[mode]) for mode in MODES}


def faulty_run(e2e, mode: str) -> dict:
    """The mode's example with its victim's train.py SIGKILLed right after the first save; what the test checks."""
    doc = script_example(MANIFESTS[mode], ARGS)
    job = doc["metadata"]["name"] = f"fault-{job_name(doc)}"
    pod = f"{job}-{VICTIM[mode]}"
    apply(e2e, doc)
    checkpoint = first_checkpoint(e2e, f"{job}-{CHIEF[mode]}")
    old_uid = e2e.get("pod", pod)["metadata"]["uid"]
    # The user's python, the child of `python -m kubetrain.trainer script` (Single: the pod's one
    # process tree; DDP: rank 1's, under torchrun in its pod).
    sigkill_process(e2e, pod, "train.py")
    killed = time.monotonic()
    # Single: the supervisor exits 137 and the operator replaces the pod. DDP: torchrun restarts
    # the group in place, so the same pod answers again, from a new process.
    after = first_step(e2e, pod, not_uid=old_uid if mode == "single" else None)
    # What the ranks printed, read while their pods run (a finished DDP job's pods go): every rank
    # restored before that first step.
    printed: dict[int, list[int]] = {}
    for replica in CLAIMS[mode]:
        for rank, step in RESUMED.findall(logs(e2e, f"{job}-{replica}")):
            printed.setdefault(int(rank), []).append(int(step))
    status = succeeded(e2e, job)
    return {"job": job, "saved": int(checkpoint.metrics["kubetrain_last_checkpoint_step"]), "after": after,
            "seconds": after.at - killed, "printed": printed, "status": status, "files": run_files(e2e, mode, job),
            "reasons": warning_reasons(e2e, job)}


def test_sigkilled_scripts_resume_from_their_saves_and_end_with_the_fault_free_weights(e2e, custom_image):
    reference = fault_free(e2e)
    with ThreadPoolExecutor(len(MODES)) as pool:  # Single and DDP side by side: their waits overlap
        runs = dict(zip(MODES, pool.map(lambda m: faulty_run(e2e, m), MODES)))

    for mode, run in runs.items():
        saved, after, printed, status = run["saved"], run["after"], run["printed"], run["status"]
        assert STEPS > saved >= 50, (mode, saved)
        assert after.metrics["kubetrain_training_step"] > saved, (mode, after.metrics)
        for replica, found in run["files"].items():
            starts = [e for e in found["events"] if e["event"] == "start"]
            resumes = [e["step"] for e in found["events"] if e["event"] == "resume"]
            # Every start after the first resumed, from the save seen before the kill or a later one.
            assert len(starts) >= 2 and len(resumes) >= len(starts) - 1, (replica, found["events"])
            assert resumes and min(resumes) >= saved, (replica, resumes, saved)
        assert sorted(printed) == list(range(len(CLAIMS[mode]))), (mode, printed)  # every rank said it resumed ...
        assert min(min(steps) for steps in printed.values()) >= saved, (mode, printed, saved)  # ... never from 0
        if mode == "single":
            assert status["restarts"] >= 1 and "Killed" in run["reasons"], status
        values = final_values(run["files"][CHIEF[mode]]["results"])
        assert status["progress"]["step"] == STEPS, status
        assert values == reference[mode], (mode, values, reference[mode])  # the same weights, bit for bit
        figure(f"{run['job']}: SIGKILL of {VICTIM[mode]}'s train.py after save {saved} -> first step of the new "
               f"process {run['seconds']:.1f} s later (at step {after.metrics['kubetrain_training_step']:.0f}); "
               f"resumed from {printed}; restarts {status.get('restarts', 0)}; eval_loss {values['eval_loss']!r}, "
               f"weight_norm {values['weight_norm']!r} (fault-free {reference[mode]['eval_loss']!r}, "
               f"{reference[mode]['weight_norm']!r})")


# Reads the dataset the pod template mounts at /data, checks kubetrain's own mounts beside it, reports
# what it found (a value per name, 1 for yes), and holds until the test has read its /metrics.
DATASET_SCRIPT = """
import csv, os, pathlib, time
import kubetrain

rows = list(csv.DictReader(open("/data/points.csv")))


def writable(path):
    try:
        (path / "probe").write_text("ok")
        return 1
    except OSError:
        return 0


kubetrain.report(1, total_steps=1, rows=len(rows), y_sum=sum(float(r["y"]) for r in rows),
                 config_readable=int(pathlib.Path(os.environ["KUBETRAIN_JOB_FILE"]).is_file()
                                     and os.environ["KUBETRAIN_JOB_FILE"].startswith("/etc/kubetrain/")),
                 checkpoints_writable=writable(kubetrain.checkpoint_dir()),
                 checkpoints_on_volume=int(str(kubetrain.checkpoint_dir()).startswith("/kubetrain/data/")),
                 tmp_writable=writable(pathlib.Path("/tmp")),
                 dataset_read_only=1 - writable(pathlib.Path("/data")),
                 root_read_only=1 - writable(pathlib.Path.cwd()))
print(f"dataset: {len(rows)} rows", flush=True)
deadline = time.monotonic() + 300
while not os.path.exists("/tmp/release") and time.monotonic() < deadline:
    time.sleep(0.2)
"""
DATASET = "x,y\n1,2\n3,4\n5,6\n"
KUBETRAIN_MOUNTS = {"/etc/kubetrain": "config", "/kubetrain/data": "data", "/tmp": "tmp"}


def test_script_reads_a_dataset_volume_from_the_pod_template_beside_kubetrains_mounts(e2e, custom_image):
    job = "custom-dataset"
    e2e.kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{job}-points"},
                    "data": {"points.csv": DATASET}})
    doc = on_real_node({
        "apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": job},
        "spec": {
            "mode": "Single", "image": custom_image,
            "script": {"command": ["python", "-c", DATASET_SCRIPT]},
            "podTemplate": {"spec": {
                "volumes": [{"name": "dataset", "configMap": {"name": f"{job}-points"}}],
                "containers": [{"name": "trainer",
                                "volumeMounts": [{"name": "dataset", "mountPath": "/data", "readOnly": True}]}],
            }},
        },
    })
    apply(e2e, doc)
    pod = f"{job}-single-0"
    seen = watch_metrics(e2e, pod, lambda m: "kubetrain_reported_metric/root_read_only" in m, "to report the dataset")

    spec = e2e.get("pod", pod)["spec"]
    [trainer] = [c for c in spec["containers"] if c["name"] == "trainer"]
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    assert mounts.items() >= (KUBETRAIN_MOUNTS | {"/data": "dataset"}).items(), mounts
    assert {"config", "data", "tmp", "dataset"} <= {v["name"] for v in spec["volumes"]}, spec["volumes"]
    reported = {k.split("/", 1)[1]: v for k, v in seen.metrics.items() if k.startswith("kubetrain_reported_metric/")}
    expected = {"rows": 3, "y_sum": 12, "config_readable": 1, "checkpoints_writable": 1, "checkpoints_on_volume": 1,
                "tmp_writable": 1, "dataset_read_only": 1, "root_read_only": 1}
    assert reported == expected, reported
    # The operator reads the same values from the pod's /metrics into the status while it runs.
    metrics = e2e.wait(f"{job}'s status.progress.metrics",
                       lambda: ((e2e.get("trainingjob", job).get("status") or {}).get("progress") or {}).get("metrics"),
                       timeout=60)

    e2e.kubectl("exec", pod, "-c", "trainer", "--", "python", "-c", "open('/tmp/release', 'w').close()")
    status = succeeded(e2e, job)
    assert metrics == expected, metrics
    assert "dataset: 3 rows" in logs(e2e, pod)
    figure(f"{job}: a ConfigMap mounted at /data through spec.podTemplate read by the script beside "
           f"{', '.join(KUBETRAIN_MOUNTS)}; reported {reported}; Succeeded at step {status['progress']['step']}")
