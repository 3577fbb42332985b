"""kubetrain.Client(local=True): every call against real `kubetrain run` processes in a runs directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
import torch
import yaml

import kubetrain
from helpers.wait import wait_for
from kubetrain.client import (
    ClientError, InvalidManifest, JobEnded, JobExists, JobNotFound, WaitTimeout,
)
from support import EXAMPLES, kubetrain as kubetrain_cli


def single(name: str, epochs: int = 3, **training) -> dict:
    doc = yaml.safe_load((EXAMPLES / "single.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"].update(epochs=epochs, **training)
    return doc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def client(runs):
    return kubetrain.Client(local=True, runs_dir=runs)


@pytest.fixture(scope="module")
def finished(client):
    """One Single job run to its end through the client."""
    handle = client.create(single("done"))
    job = handle.wait(timeout=300, progress=False)
    assert job.state == "Succeeded", client.events("done")
    return handle


def test_a_created_job_runs_to_its_end_and_reads_as_the_typed_status(client, finished):
    job = client.get(finished.name)
    assert (job.name, job.mode, job.state, job.restarts) == ("done", "Single", "Succeeded", 0)
    assert job.progress.step == job.progress.total_steps > 0
    assert job.progress.loss is not None and job.progress.eta_seconds == 0
    assert job.last_checkpoint is not None and job.last_checkpoint.step == job.progress.step
    assert [c.type for c in job.conditions if c.status == "True"] == ["Created", "Succeeded"]
    assert job.condition.reason == "Completed"
    assert [j.name for j in client.list()] == ["done"]
    assert [e.reason for e in client.events("done")] == ["Completed"]


def test_logs_are_every_replicas_lines_prefixed_or_one_replicas_plain(client, finished):
    every = list(client.logs("done"))
    assert every and all(line.startswith("[single-0] ") for line in every)
    assert any("eval accuracy" in line for line in every)
    assert list(client.logs("done", replica="single-0")) == [line.removeprefix("[single-0] ") for line in every]
    with pytest.raises(ClientError, match=r"done: no replica 'worker-0'; this job has single-0"):
        list(client.logs("done", replica="worker-0"))


def test_export_writes_the_models_state_dict(client, finished, tmp_path):
    path = client.export("done", tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert any(k.endswith("weight") for k in state)


def test_the_cli_reads_the_same_local_runs(runs, finished, tmp_path):
    waited = kubetrain_cli("wait", "done", "--local", "--runs-dir", str(runs))
    assert (waited.returncode, waited.stdout.strip()) == (0, "done: Succeeded"), waited.stderr
    logs = kubetrain_cli("logs", "done", "--local", "--runs-dir", str(runs), "--replica", "single-0")
    assert logs.returncode == 0 and "eval accuracy" in logs.stdout
    out = tmp_path / "cli-model.pt"
    exported = kubetrain_cli("export", "done", "--local", "--runs-dir", str(runs), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert torch.load(out, weights_only=True).keys() == torch.load(
        kubetrain.Client(local=True, runs_dir=runs).export("done", tmp_path / "again.pt"), weights_only=True).keys()
    missing = kubetrain_cli("wait", "nope", "--local", "--runs-dir", str(runs))
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"kubetrain: nope: no such job in runs directory {runs} (no {runs}/nope/job.yaml)"
    assert "Traceback" not in missing.stderr


def test_wait_raises_when_the_job_ended_otherwise_or_time_ran_out(client, finished):
    with pytest.raises(JobEnded, match=r"done: ended Succeeded \(Completed: .*\) while waiting for Running") as err:
        client.wait("done", until="Running", progress=False)
    assert err.value.job.state == "Succeeded"
    with pytest.raises(ClientError, match=r"'Done' is no job state; the states are Created, Running"):
        client.wait("done", until=("Done",))
    with pytest.raises(JobNotFound, match="nope: no such job in runs directory"):
        client.wait("nope")


def test_an_invalid_manifest_is_refused_with_the_lines_of_kubetrain_validate(client, tmp_path):
    bad = single("bad")
    bad["spec"]["training"]["batchSize"] = 0
    bad["spec"]["mode"] = "Singel"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    validate = kubetrain_cli("validate", str(path))
    assert validate.returncode == 2
    with pytest.raises(InvalidManifest) as err:
        client.create(path)
    assert err.value.problems == validate.stderr.strip().splitlines()
    assert any("spec.training.batchSize" in p for p in err.value.problems)
    with pytest.raises(InvalidManifest, match=r"\(manifest\): spec.mode"):
        client.create(yaml.safe_dump(bad))  # YAML text
    with pytest.raises(InvalidManifest, match=r"\(manifest\): spec.mode"):
        client.create(bad)  # a dict
    with pytest.raises(InvalidManifest, match="no such file"):
        client.create(tmp_path / "missing.yaml")
    assert not (client.backend.runs_dir / "bad").exists()  # nothing was started


def test_a_name_taken_is_refused(client, finished):
    with pytest.raises(JobExists, match="done: a job of that name exists"):
        client.create(single("done"))


def test_logs_follow_a_replica_across_its_restart_until_the_job_ends(client):
    """The replica is SIGKILLed from outside after its first steps; the supervisor restarts it (OnFailure) and
    the same iterator goes on with the new attempt's lines, and stops once the job has succeeded."""
    client.create(single("follow", epochs=8))
    seen: list[str] = []
    pid = killed = None
    for line in client.logs("follow", replica="single-0", follow=True):
        seen.append(line)
        started = re.search(r'kubetrain-startup \{"milestone": "process".*"pid": (\d+)', line)
        if started and pid is None:
            pid = int(started.group(1))
        if killed is None and pid is not None and re.search(r"single-0: step \d+", line):
            os.kill(pid, signal.SIGKILL)
            killed = pid
    assert killed is not None, seen[-20:]
    attempts = [i for i, line in enumerate(seen) if line.startswith("--- kubetrain: attempt")]
    assert len(attempts) == 2, seen
    assert any(re.search(r"single-0: step \d+", line) for line in seen[attempts[1]:]), seen[attempts[1]:]
    job = client.get("follow")
    assert (job.state, job.restarts) == ("Succeeded", 1)
    assert any(e.reason == "Killed" for e in client.events("follow")), client.events("follow")


def test_suspend_stops_after_a_checkpoint_and_resume_continues_from_it(client):
    handle = client.create(single("pause", epochs=40))
    wait_for("a checkpoint", lambda: (j := client.get("pause")).last_checkpoint and j.last_checkpoint.step > 0,
             timeout=120, every=0.3)
    client.suspend("pause")
    paused = client.get("pause")
    assert paused.state == "Suspended"
    assert client.backend.run_dir("pause").supervisor() is None
    with pytest.raises(WaitTimeout, match="pause: still Suspended at step") as err:
        client.wait("pause", timeout=1, progress=False)
    assert err.value.job.state == "Suspended"
    step = paused.last_checkpoint.step
    client.resume("pause")
    done = handle.wait(timeout=300, progress=False)
    assert done.state == "Succeeded"
    resumed = json.loads([line for line in (client.backend.runs_dir / "pause" / "metrics" / "single-0.jsonl")
                          .read_text().splitlines() if '"resume"' in line][-1])
    assert resumed["step"] >= step


def test_scale_rewrites_the_runs_size_and_refuses_one_the_job_cannot_take(client, finished):
    with pytest.raises(InvalidManifest, match="spec.replicas"):
        client.scale("done", 3)  # a Single job has one replica
    with pytest.raises(ClientError, match="replicas must be a whole number"):
        client.scale("done", "2")


def test_delete_stops_and_removes_the_run(client):
    client.create(single("gone", epochs=40))
    run = client.backend.run_dir("gone")
    assert run.supervisor() is not None
    client.delete("gone")
    assert not run.path.exists()
    with pytest.raises(JobNotFound):
        client.get("gone")
    # Nothing of it runs on: its supervisor took its replicas down.
    assert subprocess.run(["pgrep", "-f", str(run.path)], capture_output=True).stdout == b""
