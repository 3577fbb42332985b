"""Elastic jobs on this machine: `kubetrain scale` while `kubetrain run` trains. A ParameterServer job
goes 2 -> 3 -> 1 workers and a DDP job 2 -> 1 -> 2 nodes; each resize stops the replicas after a
checkpoint and starts the new set, the rest of the epoch dealt again among them (tests/trainer/
test_redeal.py holds the no-sample-twice proof); both finish within 2 points of accuracy of the same
job run at a fixed size, with no restart counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers.jsonl import read_jsonl
from kubetrain.shared.launch import SLOWDOWN_VAR
from support import job_doc, kubetrain

RESIZE_TIMEOUT_SECONDS = 120  # a resize: the replicas stop (SIGTERM, a checkpoint) and the new set starts
RUN_TIMEOUT_SECONDS = 480


def manifest(tmp_path: Path, name: str, mode: str, epochs: int, **extra) -> Path:
    checkpoint = {"intervalSteps": 50, **extra.pop("checkpoint", {})}
    doc = job_doc(name, mode, model={"name": "mlp", "args": {"hidden": 64}}, dataset={"name": "digits"},
                  training={"epochs": epochs, "batchSize": 32, "seed": 0,
                            "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}},
                  checkpoint=checkpoint, **extra)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def chief_step(run: Path, chief: str) -> int:
    steps = [e["step"] for e in read_jsonl(run / "metrics" / f"{chief}.jsonl") if e.get("event") == "train"]
    return max(steps, default=0)


def size_running(run: Path) -> int | None:
    try:
        return json.loads((run / "state.json").read_text())["status"].get("replicas")
    except (OSError, ValueError, KeyError):
        return None


FIRST_RESIZE_STEP = 120
SLOWDOWN = 20  # see test_a_job_scaled_twice_finishes_within_two_points_of_a_fixed_size_run
FSDP_SLOWDOWN = 5
STEPS_BETWEEN_RESIZES = 80  # counted from the chief's step once the previous resize is done: mid-run, always


def run_with_resizes(path: Path, run: Path, chief: str, sizes: list[int],
                     environ: dict[str, str]) -> tuple[int, str]:
    """`kubetrain run` (`environ` added to its environment), and `kubetrain scale` to each size: the first
    once the chief passed FIRST_RESIZE_STEP, each next STEPS_BETWEEN_RESIZES steps after the previous
    resize was done (the run directory's status says the new size)."""
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.cli", "run", str(path), "--run-dir", str(run),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **environ})
    try:
        at_step = FIRST_RESIZE_STEP
        for size in sizes:
            deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
            while chief_step(run, chief) < at_step:
                assert proc.poll() is None, f"the run ended before step {at_step}:\n{proc.stdout.read()}"
                assert time.monotonic() < deadline, f"no step {at_step} in {RUN_TIMEOUT_SECONDS} s"
                time.sleep(0.2)
            scaled = kubetrain("scale", str(run), "--replicas", str(size))
            assert scaled.returncode == 0, scaled.stderr
            deadline = time.monotonic() + RESIZE_TIMEOUT_SECONDS
            while size_running(run) != size:
                assert proc.poll() is None, f"the run ended before it was resized to {size}:\n{proc.stdout.read()}"
                assert time.monotonic() < deadline, f"not resized to {size} in {RESIZE_TIMEOUT_SECONDS} s"
                time.sleep(0.2)
            at_step = chief_step(run, chief) + STEPS_BETWEEN_RESIZES
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_SECONDS)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode, spec, chief, sizes, unit", [
    ("ParameterServer", {"parameterServer": {"workers": 2}}, "worker-0", [3, 1], "workers"),
    ("DDP", {"ddp": {"nodes": 2, "minNodes": 1, "maxNodes": 2}}, "ddp-0", [1, 2], "nodes"),
    # FSDP with its sharded checkpoints in object storage (the real S3 server): no shared volume at all;
    # each resize writes the shards of the old size to the bucket and the new size reads them resharded.
    ("DDP", {"ddp": {"nodes": 2, "minNodes": 1, "maxNodes": 2, "strategy": "FSDP"},
             "checkpoint": {"storage": {"uri": "s3://{bucket}/elastic/"}}}, "ddp-0", [1, 2], "nodes"),
], ids=["ps-2-3-1", "ddp-2-1-2", "fsdp-2-1-2-s3"])
def test_a_job_scaled_twice_finishes_within_two_points_of_a_fixed_size_run(tmp_path, mode, spec, chief, sizes, unit,
                                                                           request):
    # 575 steps at 2 replicas (digits, batch 32) in 25 epochs: the resizes must land mid-run. At full speed
    # they need not: a live resize (ParameterServer) costs no restart, and the job would run on at a hundred
    # steps a second and more (its tensors on the data plane) while ps-0 reads the new size and worker-2
    # starts (7 s and more under load), and end before the second resize; a DDP group of one rank has no
    # allreduce and ran its last 526 steps in 1.1 s, before the test's `kubetrain scale` to 2 (a CI run,
    # 2026-12-03). Every replica sleeps instead (the straggler knob, kubetrain/trainer/testhooks.py: SLOWDOWN - 1 times
    # each step's compute, the same for all, no CPU): the same 25 epochs, at a pace that keeps the resizes
    # mid-run. The fixed-size run is not slowed: a sleep changes no update. FSDP's steps cost several times
    # DDP's: slowed FSDP_SLOWDOWN times (its run 16 s at full speed, 71 s slowed 20 times, alone).
    epochs = 25
    replicas = [f"worker-{i}" for i in range(3)] if mode == "ParameterServer" else ["ddp-0", "ddp-1"]
    factor = FSDP_SLOWDOWN if spec.get("ddp", {}).get("strategy") == "FSDP" else SLOWDOWN
    slow = {SLOWDOWN_VAR: ",".join(f"{replica}:{factor}" for replica in replicas)}
    store_env: dict[str, str] = {}
    fixed_spec = spec
    uri = spec.get("checkpoint", {}).get("storage", {}).get("uri", "")
    if uri:
        s3 = request.getfixturevalue("s3")
        store_env, bucket = s3.env, s3.bucket()
        spec = {**spec, "checkpoint": {"storage": {"uri": uri.format(bucket=bucket)}}}
        fixed_spec = {**spec, "checkpoint": {"storage": {"uri": f"s3://{bucket}/fixed/"}}}
    fixed = kubetrain("run", str(manifest(tmp_path, "fixed", mode, epochs, **fixed_spec)),
                      "--run-dir", str(tmp_path / "fixed"), "--quiet", timeout=RUN_TIMEOUT_SECONDS, env=store_env)
    assert fixed.returncode == 0, fixed.stderr
    baseline = json.loads((tmp_path / "fixed" / "summary.json").read_text())

    run = tmp_path / "elastic"
    code, out = run_with_resizes(manifest(tmp_path, "elastic", mode, epochs, **spec), run, chief, sizes,
                                 {**slow, **store_env})
    assert code == 0, out
    summary = json.loads((run / "summary.json").read_text())
    print(f"\n{mode} 2 -> {sizes[0]} -> {sizes[1]}: accuracy {summary['eval_accuracy']:.4f}, the same job at a "
          f"fixed size {baseline['eval_accuracy']:.4f}, {epochs} epochs, {summary['wall_seconds']:.1f} s "
          f"(fixed {baseline['wall_seconds']:.1f} s)")
    assert summary["state"] == "Succeeded" and summary["restarts"] == 0, summary
    assert abs(summary["eval_accuracy"] - baseline["eval_accuracy"]) <= 0.02, (summary, baseline)
    assert summary["epochs"] == pytest.approx(epochs, abs=0.01)
    first, last = sizes
    start = 2
    # The job file holds the last size; the next `kubetrain run` of the same manifest keeps it.
    assert yaml.safe_load((run / "job.yaml").read_text())["spec"]["replicas"] == last
    assert size_running(run) == last
    if mode == "ParameterServer":
        # Live: nothing stopped. ps-0 made both resizes at a cut and dealt the epoch's rest again; the
        # third worker joined and trained, and the workers above the last size were released.
        assert f"Resized from {start} to {first} {unit}, live" in out and f"Resized from {first} to {last} {unit}, live" \
            in out, out
        assert "Resizing" not in out, out
        ps_log = (run / "logs" / "ps-0.log").read_text()
        assert "membership 2, 3 workers (was 2)" in ps_log and "membership 3, 1 workers (was 3)" in ps_log, ps_log
        for replica in ("ps-0", "worker-0"):
            starts = [e for e in read_jsonl(run / "metrics" / f"{replica}.jsonl") if e.get("event") == "start"]
            assert len(starts) == 1, (replica, starts)
        assert any(e.get("event") == "train" for e in read_jsonl(run / "metrics" / "worker-2.jsonl"))
        for replica in ("worker-1", "worker-2"):
            assert any(e.get("event") == "released" for e in read_jsonl(run / "metrics" / f"{replica}.jsonl"))
    else:
        assert f"Resizing from {start} to {first} {unit}" in out and f"Resized from {first} to {last} {unit}" in out, out
        log = (run / "logs" / "ddp-0.log").read_text()
        assert "resized from 2 to 1 ranks" in log and "resized from 1 to 2 ranks" in log
        events = read_jsonl(run / "metrics" / "ddp-0.jsonl")
        stops = [e["step"] for e in events if e.get("event") == "stop"]
        starts = [e["step"] for e in events if e.get("event") == "start"]
        # Each resize stopped the group after a checkpoint of its last step, and the new size started
        # there: no step lost.
        assert len(stops) == 2 and starts[1:] == stops, (starts, stops)
        if spec["ddp"].get("strategy") == "FSDP":
            # Every restart loaded the sharded checkpoint, resharded 2 -> 1 -> 2 ranks, from the bucket.
            resumes = [e for e in events if e.get("event") == "resume"]
            assert [e["step"] for e in resumes] == stops and all(e.get("sharded") for e in resumes), resumes
            assert all(e["path"].startswith(f"s3://{bucket}/elastic/ddp-0/sharded-") for e in resumes), resumes
            saves = [e for e in events if e.get("event") == "checkpoint"]
            assert saves and all(e["uri"].startswith(f"s3://{bucket}/elastic/ddp-0/") for e in saves), saves


def test_scale_refuses_a_size_the_job_cannot_take_naming_the_field(tmp_path):
    path = manifest(tmp_path, "d", "DDP", 1, ddp={"nodes": 2, "minNodes": 1, "maxNodes": 2})
    run = tmp_path / "runs" / "d"
    run.mkdir(parents=True)
    (run / "job.yaml").write_text(path.read_text())
    before = (run / "job.yaml").read_text()
    out = kubetrain("scale", str(run), "--replicas", "3")
    assert out.returncode == 2
    assert "spec.replicas: a DDP job runs between ddp.minNodes (1) and ddp.maxNodes (2) nodes, got 3" in out.stderr
    assert "Traceback" not in out.stderr
    assert (run / "job.yaml").read_text() == before  # nothing written
    missing = kubetrain("scale", str(tmp_path / "nowhere"), "--replicas", "1")
    assert missing.returncode == 2 and "nowhere" in missing.stderr and "Traceback" not in missing.stderr
