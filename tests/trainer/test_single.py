"""The Single trainer learns digits, follows its golden loss curve, and resumes exactly after a crash."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers.jsonl import read_events
from kubetrain.api.identity import JobIdentity
from kubetrain.trainer.checkpoint import CheckpointStore
from kubetrain.trainer.errors import EXIT_OK, EXIT_TERMINATED
from kubetrain.trainer.single import run_single

from golden import GOLDEN, GOLDEN_OVERRIDES, GOLDEN_STEPS

GOLDEN_TOLERANCE = 1e-4
RESULT_FIELDS = {
    "steps", "epochs", "final_train_loss", "eval_accuracy", "eval_loss", "samples", "samples_per_second",
    "wall_seconds", "bytes_sent", "bytes_received", "raw_gradient_bytes", "compressed_gradient_bytes",
    "checkpoint_step", "checkpoint_time",
}


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    return read_events(run_dir / "metrics" / "single-0.jsonl", name)


def final_parameters(ctx) -> tuple[int, dict[str, torch.Tensor]]:
    store = CheckpointStore(ctx.checkpoint_dir, ctx.spec.checkpoint.keep_last, JobIdentity.of(ctx.spec))
    step, state = store.load_latest()
    return step, state["model"]


def test_default_mlp_reaches_95_percent_on_digits(write_job, make_ctx, tmp_path: Path) -> None:
    ctx = make_ctx(write_job())  # the default spec: mlp 128, sgd 0.05/0.9, batch 64, 10 epochs
    ctx.termination_log = tmp_path / "termination-log"  # a pod's /dev/termination-log
    assert run_single(ctx) == EXIT_OK
    result = json.loads((tmp_path / "run" / "results" / "single-0.json").read_text())
    assert set(result) == RESULT_FIELDS
    message = json.loads(ctx.termination_log.read_text())
    assert message == {k: result[k] for k in ("steps", "final_train_loss", "eval_accuracy", "eval_loss",
                                              "checkpoint_step", "checkpoint_time", "samples_per_second",
                                              "wall_seconds")}
    assert message["checkpoint_step"] == 230 and len(ctx.termination_log.read_bytes()) < 4096
    assert result["eval_accuracy"] >= 0.95, result
    assert result["steps"] == 230 and result["epochs"] == 10 and result["samples"] == 230 * 64 - 10 * 34
    assert [e["epoch"] for e in events(ctx.run_dir, "eval")] == list(range(1, 11))
    assert [i.step for i in CheckpointStore(ctx.checkpoint_dir, 3, "").list()] == [150, 200, 230]


def test_loss_curve_matches_the_golden_curve(write_job, make_ctx) -> None:
    # The curve is written by `hack/golden` (tests/trainer/golden.py), never by a test.
    ctx = make_ctx(write_job(GOLDEN_OVERRIDES))
    assert run_single(ctx) == EXIT_OK
    losses = [e["loss"] for e in events(ctx.run_dir, "train")]
    assert len(losses) == GOLDEN_STEPS
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, abs=GOLDEN_TOLERANCE)


def test_killed_and_resumed_run_matches_an_uninterrupted_one(write_job, make_ctx, run_trainer, tmp_path: Path) -> None:
    # 2 epochs of 23 steps, checkpoints at 20 and 40; the fault at 40 strikes before checkpoint 40.
    job = write_job({"training": {"epochs": 2}, "checkpoint": {"intervalSteps": 20}})
    faulty_dir = tmp_path / "faulty"
    killed = run_trainer(job, faulty_dir, KUBETRAIN_FAULT="kill@step=40")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = make_ctx(job, faulty_dir)
    assert [i.step for i in CheckpointStore(resumed.checkpoint_dir, 3, "").list()] == [20]
    assert run_single(resumed) == EXIT_OK
    assert [e["step"] for e in events(faulty_dir, "resume")] == [20]

    straight = make_ctx(job, tmp_path / "straight")
    assert run_single(straight) == EXIT_OK

    step_a, params_a = final_parameters(straight)
    step_b, params_b = final_parameters(resumed)
    assert step_a == step_b == 46
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.allclose(params_a[name], params_b[name], rtol=0, atol=1e-6), name


def test_sigterm_writes_a_checkpoint_and_exits_143(write_job, start_trainer, tmp_path: Path) -> None:
    job = write_job({"training": {"epochs": 100000}, "checkpoint": {"intervalSteps": 1000000}})
    proc = start_trainer(job, tmp_path / "run")
    jsonl = tmp_path / "run" / "metrics" / "single-0.jsonl"
    deadline = time.monotonic() + 60
    while not (jsonl.exists() and '"event": "start"' in jsonl.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_TERMINATED, stderr
    stop = events(tmp_path / "run", "stop")[0]["step"]
    checkpoints = [e["step"] for e in events(tmp_path / "run", "checkpoint")]
    assert checkpoints == [stop]
