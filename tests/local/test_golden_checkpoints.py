"""Checkpoints written by earlier releases resume under this one (issue 53): for each kind of job, the run
directory a release left when a fault stopped it (tests/assets/golden/<release>/<kind>: its job.yaml and
checkpoints) is resumed by today's `kubetrain run` with the same manifest, and must end where that release's own
resume ended (expected.json, made by hack/golden-checkpoints). A change of the math is still refused, naming the
field and both values."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import yaml

from goldenlib import GOLDEN, RELEASES, differences, kinds_of, result, run, workdir

KUBETRAIN = [sys.executable, "-m", "kubetrain.cli"]
CASES = [pytest.param(release, kind, id=f"{release}-{kind.name}") for release in RELEASES for kind in kinds_of(release)]


@pytest.mark.parametrize(("release", "kind"), CASES)
def test_a_checkpoint_of_an_earlier_release_resumes_to_that_releases_own_result(tmp_path, release, kind):
    golden = GOLDEN / release / kind.name
    expected = json.loads((golden / "expected.json").read_text())
    cwd = workdir(kind, tmp_path / "work")
    resumed = tmp_path / "run"
    shutil.copytree(golden, resumed, ignore=shutil.ignore_patterns("expected.json"))
    done = run(KUBETRAIN, kind, cwd, resumed)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for path in (resumed / "metrics").glob("*.jsonl") for line in path.read_text().splitlines()]
    resumes = sorted({e["step"] for e in events if e.get("event") == "resume"})
    assert resumes and min(resumes) > 0, "the run did not resume from the release's checkpoint"
    assert differences(kind, expected, result(resumed)) == []


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_change_of_the_math_on_an_earlier_releases_run_is_refused_naming_the_field(tmp_path, release):
    [kind] = [k for k in kinds_of(release) if k.name == "single"]
    cwd = workdir(kind, tmp_path / "work")
    manifest = cwd / kind.manifest.name
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["training"]["optimizer"]["learningRate"] = 0.1
    doc["spec"]["model"]["args"]["hidden"] = 64
    manifest.write_text(yaml.safe_dump(doc))
    resumed = tmp_path / "run"
    shutil.copytree(GOLDEN / release / kind.name, resumed, ignore=shutil.ignore_patterns("expected.json"))
    done = run(KUBETRAIN, kind, cwd, resumed)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "model.args.hidden: 32 in the run, 64 in this manifest" in done.stderr
    assert "training.optimizer.learningRate: 0.05 in the run, 0.1 in this manifest" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("release", list(RELEASES))
def test_an_earlier_releases_checkpoints_under_a_changed_manifest_are_refused_by_the_trainer(tmp_path, release):
    """Without the run's job.yaml (a claim, a copy of the checkpoints alone), the trainer judges the checkpoint's
    own record: a release that wrote only a hash is refused when no earlier release computes it for this job."""
    [kind] = [k for k in kinds_of(release) if k.name == "single"]
    cwd = workdir(kind, tmp_path / "work")
    manifest = cwd / kind.manifest.name
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["model"]["args"]["hidden"] = 64
    manifest.write_text(yaml.safe_dump(doc))
    resumed = tmp_path / "run"
    shutil.copytree(GOLDEN / release / kind.name / "checkpoints", resumed / "checkpoints")
    done = run(KUBETRAIN, kind, cwd, resumed)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "was written for a different spec" in done.stderr and "hash of an earlier release" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_job_goes_on_from_the_one_before_saying_so(tmp_path):
    """A run directory whose newest checkpoint is damaged (a torn copy, a writer of the claim): the restore sets it
    aside, kept as `.corrupt`, resumes from the one before, and the job's events say which and why."""
    [kind] = [k for k in kinds_of("0.1.0") if k.name == "single"]
    cwd = workdir(kind, tmp_path / "work")
    resumed = tmp_path / "run"
    shutil.copytree(GOLDEN / "0.1.0" / kind.name, resumed, ignore=shutil.ignore_patterns("expected.json"))
    checkpoints = resumed / "checkpoints" / "single-0"
    newest = max(checkpoints.glob("ckpt-*.pt"))
    step = int(newest.name[5:13])
    damaged = f"ckpt-{step + 1:08d}.pt"
    data = bytearray(newest.read_bytes().replace(f'"step": {step},'.encode(), f'"step": {step + 1},'.encode(), 1))
    data[-100] ^= 0xFF
    (checkpoints / damaged).write_bytes(bytes(data))
    done = run(KUBETRAIN, kind, cwd, resumed)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (checkpoints / f"{damaged}.corrupt").is_file()
    trainer = [json.loads(line) for line in (resumed / "metrics" / "single-0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in trainer if e["event"] == "resume"] == [step]
    [aside] = [e for e in trainer if e["event"] == "checkpoint_set_aside"]
    assert aside["checkpoint"].endswith(damaged) and "sha256" in aside["reason"]
    engine = [json.loads(line) for line in (resumed / "events.jsonl").read_text().splitlines()]
    warned = [e for e in engine if e.get("reason") == "CheckpointSetAside"]
    assert len(warned) == 1 and damaged in warned[0]["message"] and "sha256" in warned[0]["message"]
