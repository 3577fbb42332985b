"""Checkpoint validation on real runs: good checkpoints pass, damaged or foreign ones are caught with a clear message."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from support import job_doc

from kubetrain.api import from_object
from kubetrain.cli.commands import UsageError, recovery_check
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir
from kubetrain.trainer.verify import (
    EXIT_INVALID, EXIT_OK, EXIT_USAGE, VerifyError, main_compare, main_verify, verify_checkpoints,
)

pytestmark = pytest.mark.slow


def small_job(name: str, learning_rate: float = 0.05) -> dict:
    return job_doc(
        name, "Single",
        model={"name": "mlp", "args": {"hidden": 32}}, dataset={"name": "digits"},
        training={"maxSteps": 60, "batchSize": 32, "seed": 0,
                  "optimizer": {"name": "sgd", "learningRate": learning_rate, "momentum": 0.9}},
        checkpoint={"intervalSteps": 20, "keepLast": 3},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The recovery check of a small Single job (a clean and a faulted run), and a run of another job."""
    root = tmp_path_factory.mktemp("verify")
    manifest = root / "small.yaml"
    manifest.write_text(yaml.safe_dump(small_job("small")))
    recovery = recovery_check(manifest, "single-0:kill@step=30", root / "recovery", stream=io.StringIO())
    other = root / "other"
    assert LocalRunner(from_object(small_job("other", 0.1)), RunDir(other), echo_logs=False).run_job() == 0
    return {"recovery": recovery, "clean": root / "recovery" / "clean", "faulted": root / "recovery" / "faulted",
            "other": other, "manifest": manifest}


def verify(*args, **kw) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main_verify(*args, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def test_recovery_check_finds_the_resumed_run_equal_to_the_clean_one(runs):
    report = runs["recovery"]
    assert report["ok"], report["problems"]
    assert report["restarts"] == 1 and report["criterion"] == "parameters" and report["tolerance"] == 1e-6
    diff = report["comparison"]["comparisons"][0]
    assert diff["same_step"] and diff["max_abs_diff"] <= 1e-6


def test_verify_passes_every_checkpoint_of_a_run_and_evaluates_it(runs):
    code, out, err = verify(runs["clean"])
    assert code == EXIT_OK, err
    assert "all checkpoints are valid" in out
    report = verify_checkpoints(runs["clean"])
    steps = [c["step"] for c in report["replicas"]["single-0"]["checkpoints"]]
    assert steps == [20, 40, 60] and report["job"] == "small"
    # The final checkpoint's model scores what the run itself reported.
    summary = json.loads((runs["clean"] / "summary.json").read_text())
    final = report["evaluations"][-1]
    assert final["step"] == 60
    assert final["eval_accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-6)


def damaged_copy(runs, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of the clean run with one checkpoint damaged; returns it and the damaged file's name."""
    run = tmp_path / "run"
    shutil.copytree(runs["clean"], run)
    ckpts = run / "checkpoints" / "single-0"
    target = ckpts / "ckpt-00000060.pt"
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "not a checkpoint":
        target.write_bytes(b"PK\x03\x04 a zip file, not ours")
    elif damage == "another job":
        shutil.copy(runs["other"] / "checkpoints" / "single-0" / "ckpt-00000060.pt", target)
    elif damage == "renamed":
        target.unlink()
        shutil.copy(ckpts / "ckpt-00000040.pt", target)
    return run, target.name


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "corrupt: payload is"),
        ("flipped byte", "corrupt: sha256 mismatch"),
        ("not a checkpoint", "corrupt: not a kubetrain checkpoint"),
        ("another job", "written for another job: training.optimizer.learningRate: 0.1 in the checkpoint, 0.05 in this job"),
        ("renamed", "its header says step 40, its name step 60"),
    ],
)
def test_verify_catches_a_bad_checkpoint_and_names_it(runs, tmp_path, damage, message):
    run, name = damaged_copy(runs, tmp_path, damage)
    code, out, err = verify(run)
    assert code == EXIT_INVALID, out
    assert message in err and name in err, err
    assert "1 problem(s)" in out
    report = verify_checkpoints(run)
    verdicts = {Path(c["file"]).name: c["ok"] for c in report["replicas"]["single-0"]["checkpoints"]}
    assert verdicts == {"ckpt-00000020.pt": True, "ckpt-00000040.pt": True, "ckpt-00000060.pt": False}
    assert [e["step"] for e in report["evaluations"]] == [20, 40]  # the good ones are still evaluated


def test_verify_refuses_checkpoints_against_another_jobs_manifest(runs, tmp_path):
    other_manifest = tmp_path / "other.yaml"
    other_manifest.write_text(yaml.safe_dump(small_job("other", 0.1)))
    code, out, err = verify(runs["clean"] / "checkpoints" / "single-0", other_manifest)
    assert code == EXIT_INVALID
    assert err.count("written for another job") == 3


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing directory", "no such directory"),
        ("empty directory", "no checkpoints here"),
        ("a file", "not a directory"),
        ("bad job file", "not a valid TrainingJob"),
    ],
)
def test_verify_bad_input_is_a_usage_error_with_a_clear_message(runs, tmp_path, case, message):
    target, job_file = tmp_path / "nothing", None
    if case == "empty directory":
        target.mkdir()
    elif case == "a file":
        target.write_text("")
    elif case == "bad job file":
        target = runs["clean"]
        job_file = tmp_path / "bad.yaml"
        job_file.write_text(yaml.safe_dump({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                                            "metadata": {"name": "x"}, "spec": {"mode": "Nope"}}))
    code, out, err = verify(target, job_file)
    assert code == EXIT_USAGE
    assert err.startswith("kubetrain checkpoints verify: error: ") and message in err, err
    assert out == ""


def test_compare_checkpoints_of_equal_and_different_runs(runs):
    out, err = io.StringIO(), io.StringIO()
    assert main_compare([runs["clean"], runs["faulted"]], out=out, err=err) == EXIT_OK
    assert "same within 1e-06" in out.getvalue()
    out = io.StringIO()
    assert main_compare([runs["clean"], runs["other"]], out=out, err=err) == EXIT_INVALID
    assert "DIFFERENT" in out.getvalue()
    assert main_compare([runs["clean"], runs["clean"].parent / "missing"], out=out, err=err) == EXIT_USAGE


@pytest.mark.parametrize("fault, message", [("single-0:explode", "expected REPLICA:kill@step=N"),
                                            ("worker-3:kill@step=5", "has no replica 'worker-3'")])
def test_recovery_check_refuses_a_bad_fault(runs, tmp_path, fault, message):
    with pytest.raises(UsageError, match=message):
        recovery_check(runs["manifest"], fault, tmp_path)
