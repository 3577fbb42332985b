"""Fixtures for trainer tests: a job manifest in tmp_path, its replica context, the trainer as a process."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.trainer.context import ReplicaContext

# Small and fast: digits (1438 training samples), the default MLP, 23 steps an epoch.
BASE_SPEC: dict[str, Any] = {
    "mode": "Single",
    "model": {"name": "mlp", "args": {"hidden": 128}},
    "dataset": {"name": "digits", "evalFraction": 0.2},
    "training": {
        "epochs": 10,
        "batchSize": 64,
        "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9},
        "seed": 0,
        "device": "cpu",
    },
    "checkpoint": {"intervalSteps": 50, "keepLast": 3},
    "metrics": {"port": 0},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, dicts recursively; a None value removes the key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
def write_job(tmp_path: Path) -> Callable[..., Path]:
    """write_job({"training": {"maxSteps": 30, "epochs": None}}) -> path of a job.yaml in tmp_path."""

    def write(overrides: dict[str, Any] | None = None, name: str = "job") -> Path:
        doc = {
            "apiVersion": "kubetrain.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": merged(BASE_SPEC, overrides or {}),
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    return write


def trainer_env(job_file: Path, run_dir: Path, **extra: str) -> dict[str, str]:
    """The environment the local backend gives a Single replica, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
    env.update(
        KUBETRAIN_JOB_FILE=str(job_file),
        KUBETRAIN_RUN_DIR=str(run_dir),
        KUBETRAIN_REPLICA="single-0",
        KUBETRAIN_CHECKPOINT_DIR=str(run_dir / "checkpoints" / "single-0"),
        KUBETRAIN_METRICS_PORT="0",
    )
    env.update(extra)
    return env


@pytest.fixture
def make_ctx(tmp_path: Path) -> Callable[..., ReplicaContext]:
    """make_ctx(job_file, run_dir=None) -> the context `python -m kubetrain.trainer single` would build."""

    def make(job_file: Path, run_dir: Path | None = None) -> ReplicaContext:
        return ReplicaContext.from_env("single", trainer_env(job_file, run_dir or tmp_path / "run"))

    return make


def _start(job_file: Path, run_dir: Path, role: str = "single", **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kubetrain.trainer", role],
        env=trainer_env(job_file, run_dir, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def start_trainer() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """start_trainer(job_file, run_dir, role="single", **env) -> the running `python -m kubetrain.trainer`."""
    started: list[subprocess.Popen[str]] = []

    def start(job_file: Path, run_dir: Path, role: str = "single", **env: str) -> subprocess.Popen[str]:
        started.append(_start(job_file, run_dir, role, **env))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def run_trainer() -> Callable[..., subprocess.CompletedProcess[str]]:
    """run_trainer(job_file, run_dir, role="single", **env) -> the finished process (120 s at most)."""

    def run(job_file: Path, run_dir: Path, role: str = "single", **env: str) -> subprocess.CompletedProcess[str]:
        proc = _start(job_file, run_dir, role, **env)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    return run


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    """Restore pytest's SIGTERM handler after a test that runs the trainer's main() in-process."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def set_trainer_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """set_trainer_env(job_file, run_dir, **extra): os.environ as `python -m kubetrain.trainer` would see it."""

    def set_env(job_file: Path, run_dir: Path, **extra: str) -> None:
        for key in list(os.environ):
            if key.startswith("KUBETRAIN_"):
                monkeypatch.delenv(key)
        for key, value in trainer_env(job_file, run_dir, **extra).items():
            if key.startswith("KUBETRAIN_"):
                monkeypatch.setenv(key, value)

    return set_env
