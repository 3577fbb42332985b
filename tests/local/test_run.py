"""`kubetrain run`: the local backend runs, supervises, resumes and summarises a job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from helpers.jsonl import read_events
from support import EXAMPLES, job_doc, kubetrain
from kubetrain.drivers.local.summary import SUMMARY_KEYS
from kubetrain.api import load_one
from kubetrain.api.identity import JobIdentity
from kubetrain.shared.launch import STARTUP_TAG
from kubetrain.trainer.checkpoint import CheckpointStore


def final_parameters(run_dir, replica="single-0"):
    spec = load_one(run_dir / "job.yaml").spec
    store = CheckpointStore(run_dir / "checkpoints" / replica, keep_last=100, identity=JobIdentity.of(spec))
    step, state = store.load_latest()
    return step, state["model"]


def test_quickstart_runs_to_completion_and_writes_the_run_directory(tmp_path):
    run = tmp_path / "run"
    proc = kubetrain("run", str(EXAMPLES / "quickstart.yaml"), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert tuple(summary) == SUMMARY_KEYS
    assert summary["state"] == "Succeeded"
    assert summary["eval_accuracy"] >= 0.95
    assert summary["restarts"] == 0
    job = yaml.safe_load((run / "job.yaml").read_text())
    assert job["spec"]["training"]["optimizer"]["weightDecay"] == 0.0  # defaults filled in
    assert (run / "logs" / f"{replica_of(summary)}.log").read_text()
    assert (run / "metrics" / f"{replica_of(summary)}.jsonl").read_text().count('"event": "eval"') >= 1
    assert "eval_accuracy" in proc.stderr  # the summary is printed
    # A normal run reads as normal: no WARNING (the workers' wait for a parameter server that is still starting
    # is an INFO line) and no raw start-up milestones on the console, which the replicas' logs keep.
    console = proc.stdout + proc.stderr
    assert "WARNING" not in console and STARTUP_TAG not in console, console
    assert "[worker-0]" in console  # the replicas' own lines are still echoed
    for replica in ("ps-0", "worker-0", "worker-1"):
        assert f'{STARTUP_TAG} {{"milestone": "first_step"' in (run / "logs" / f"{replica}.log").read_text()

    again = kubetrain("run", str(EXAMPLES / "quickstart.yaml"), "--run-dir", str(run))
    assert again.returncode == 0
    assert "already finished" in again.stderr
    assert json.loads((run / "summary.json").read_text()) == summary


def replica_of(summary):
    return {"Single": "single-0", "ParameterServer": "worker-0", "DDP": "ddp-0"}[summary["mode"]]


def test_killed_replica_resumes_to_the_same_parameters(tmp_path, write_job):
    doc = job_doc("resume", training={"epochs": 3, "seed": 7}, checkpoint={"intervalSteps": 20})
    path = write_job(doc)
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    assert kubetrain("run", str(path), "--run-dir", str(clean), "--quiet").returncode == 0
    proc = kubetrain("run", str(path), "--run-dir", str(faulty), "--fault", "single-0:kill@step=45", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "single-0 was killed by SIGKILL; restart 1 of 6." in proc.stderr
    state = json.loads((faulty / "state.json").read_text())
    [restart] = state["restart_log"]
    assert (restart["reason"], restart["exit_code"]) == ("Killed", 137)
    # Checkpoints persist in the background: the one of step 40 may still be in
    # flight when the kill at step 45 lands, and then step 20 is the newest.
    assert restart["checkpoint_step"] in (20, 40)
    step_a, params_a = final_parameters(clean)
    step_b, params_b = final_parameters(faulty)
    assert step_a == step_b
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], atol=1e-6, rtol=0)
    assert json.loads((faulty / "summary.json").read_text())["restarts"] == 1


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path, write_job):
    doc = job_doc("long", dataset={"name": "synthetic", "args": {"samples": 4096}},
                  training={"maxSteps": 3000, "batchSize": 32}, checkpoint={"intervalSteps": 25})
    path = write_job(doc)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "kubetrain.cli", "run", str(path), "--run-dir", str(run), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = run / "checkpoints" / "single-0" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert latest.exists(), "no checkpoint within 120 s"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not (run / "summary.json").exists()
    stopped_at = int(latest.read_text().split("-")[1].split(".")[0])
    resumed = kubetrain("run", str(path), "--run-dir", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    resumes = read_events(run / "metrics" / "single-0.jsonl", "resume")
    assert resumes and resumes[-1]["step"] >= stopped_at > 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3000


def test_restart_policy_never_fails_the_job(tmp_path, write_job):
    path = write_job(job_doc("never", training={"epochs": 2}, restartPolicy={"policy": "Never"}))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--fault", "single-0:kill@step=5", "--quiet")
    assert proc.returncode == 1
    assert "not restarted: restartPolicy is Never" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["state"], summary["reason"]) == ("Failed", "Killed")


def test_entrypoint_that_does_not_import_exits_3(tmp_path, write_job):
    path = write_job(job_doc("bad", model={"entrypoint": "no_such_module_xyz:build"}))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 3, proc.stderr
    assert "no_such_module_xyz" in proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["state"], summary["reason"]) == ("Failed", "LoadFailed")


@pytest.mark.parametrize(
    "name, setup, args, code, words",
    [
        ("missing dataset file", "dataset", [], 3, "spec.dataset.path: /nonexistent/data.npz: no such file"),
        ("run dir under a file", "file", [], 2, "cannot write here"),
        ("run dir of another job", "other", [], 2, "holds a run of a different spec"),
        ("bad fault syntax", None, ["--fault", "single-0:kill"], 2, "expected REPLICA:kill@step=N"),
        ("fault for unknown replica", None, ["--fault", "worker-3:kill@step=2"], 2, "has no replica 'worker-3'"),
        ("invalid manifest", "invalid", [], 2, "spec.training.batchSize: must be at least 1"),
    ],
)
def test_bad_input_is_refused_without_traces(tmp_path, write_job, name, setup, args, code, words):
    doc = job_doc("bad-input", training={"epochs": 1})
    run = tmp_path / "run"
    if setup == "dataset":
        doc["spec"]["dataset"] = {"path": "/nonexistent/data.npz"}
    elif setup == "file":
        (tmp_path / "afile").write_text("")
        run = tmp_path / "afile" / "run"
    elif setup == "other":
        run.mkdir()
        (run / "job.yaml").write_text(yaml.safe_dump(job_doc("bad-input", training={"epochs": 5})))
    elif setup == "invalid":
        doc["spec"]["training"]["batchSize"] = 0
    before = sorted(p.name for p in run.iterdir()) if run.is_dir() else None
    proc = kubetrain("run", str(write_job(doc)), "--run-dir", str(run), *args)
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
    after = sorted(p.name for p in run.iterdir()) if run.is_dir() else None
    assert after == before  # nothing written that could pass for a run


def test_metrics_targets_are_written_for_prometheus(tmp_path, write_job):
    path = write_job(job_doc("targets", training={"epochs": 1}))
    run = tmp_path / "run"
    assert kubetrain("run", str(path), "--run-dir", str(run), "--quiet").returncode == 0
    groups = json.loads((run / "targets.json").read_text())
    assert [g["labels"] for g in groups] == [{"namespace": "default", "job": "targets", "role": "single", "replica": "single-0"}]
    host, port = groups[0]["targets"][0].split(":")
    assert host == "127.0.0.1" and int(port) > 0
    (plan,) = json.loads((run / "plan.json").read_text())
    assert plan["replica"] == "single-0" and plan["command"] == ["python", "-m", "kubetrain.trainer", "single"]
    assert plan["env"]["KUBETRAIN_METRICS_PORT"] == port and plan["ports"] == {"metrics": int(port)}
    assert "KUBETRAIN_JOB_TOKEN" not in plan["env"]
