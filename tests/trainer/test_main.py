"""`python -m kubetrain.trainer` turns bad input into its exit code and a one-line message."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from kubetrain.trainer.__main__ import main
from kubetrain.trainer.errors import EXIT_CONFIG, EXIT_LOAD
from kubetrain.shared.launch import STARTUP_TAG


@dataclass
class BadRun:
    name: str
    spec: dict
    exit_code: int
    message: str
    env: dict = field(default_factory=dict)


BAD_RUNS = [
    BadRun("missing npz", {"dataset": {"name": None, "path": "{tmp}/none.npz"}}, EXIT_LOAD,
           "spec.dataset.path: {tmp}/none.npz: no such file"),
    BadRun("npz without x", {"dataset": {"name": None, "path": "{tmp}/no_x.npz"}}, EXIT_LOAD,
           "spec.dataset.path: {tmp}/no_x.npz: has no array 'x' (found y)"),
    BadRun("dataset entrypoint does not import", {"dataset": {"name": None, "entrypoint": "no_such_pkg.data:load"}},
           EXIT_LOAD, "spec.dataset.entrypoint: no_such_pkg.data:load: cannot import 'no_such_pkg.data'"),
    BadRun("model entrypoint not callable", {"model": {"name": None, "entrypoint": "math:pi"}}, EXIT_LOAD,
           "spec.model.entrypoint: math:pi: 'pi' is a float, not callable"),
    BadRun("cnn on flat synthetic features", {"model": {"name": "cnn", "args": {}}, "dataset": {"name": "synthetic"}},
           EXIT_CONFIG, "spec.model.name: cnn needs image-shaped samples"),
    BadRun("unknown model argument", {"model": {"args": {"depth": 3}}}, EXIT_CONFIG,
           "spec.model.args: mlp does not take these arguments"),
    BadRun("invalid spec", {"training": {"batchSize": 0}}, EXIT_CONFIG, "spec.training.batchSize"),
    BadRun("bad fault variable", {}, EXIT_CONFIG, "KUBETRAIN_FAULT: expected 'kill@step=N' or 'kill@save=N', got 'boom'",
           {"KUBETRAIN_FAULT": "boom"}),
    BadRun("no job file", {}, EXIT_CONFIG, "KUBETRAIN_JOB_FILE: not set", {"KUBETRAIN_JOB_FILE": ""}),
]
if not torch.cuda.is_available():
    BAD_RUNS.append(BadRun("cuda without a GPU", {"training": {"device": "cuda"}}, EXIT_CONFIG,
                           "spec.training.device: cuda asked for, but no GPU is visible"))


def messages(stderr: str) -> list[str]:
    """stderr's lines apart from the start-up milestones (events.startup), which precede any error."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(f"{STARTUP_TAG} ")]


def with_tmp(value, tmp: str):
    """The table's `{tmp}` placeholders filled with the test's tmp_path."""
    if isinstance(value, dict):
        return {k: with_tmp(v, tmp) for k, v in value.items()}
    return value.replace("{tmp}", tmp) if isinstance(value, str) else value


@pytest.mark.parametrize("case", BAD_RUNS, ids=lambda c: c.name)
def test_bad_input_exits_with_its_code_and_one_line(
    case: BadRun, write_job, set_trainer_env, keep_sigterm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "no_x.npz", y=np.zeros(4, dtype=np.int64))
    set_trainer_env(write_job(with_tmp(case.spec, str(tmp_path))), tmp_path / "run", **case.env)
    assert main(["single"]) == case.exit_code
    stderr = messages(capsys.readouterr().err)
    assert len(stderr) == 1 and case.message.replace("{tmp}", str(tmp_path)) in stderr[0], stderr


def test_the_module_prints_no_traceback(write_job, run_trainer, tmp_path: Path) -> None:
    job = write_job({"dataset": {"name": None, "path": str(tmp_path / "none.npz")}})
    done = run_trainer(job, tmp_path / "run")
    assert done.returncode == EXIT_LOAD
    assert messages(done.stderr) == [
        f"python -m kubetrain.trainer single: error: spec.dataset.path: {tmp_path}/none.npz: no such file"
    ]


def test_an_unknown_role_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["chief"])
    assert exit_.value.code == EXIT_CONFIG
