"""nccl where no GPU is visible is a configuration error (exit 2) naming spec.ddp.backend, at every level."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_group import write_job

REPO = Path(__file__).resolve().parents[2]
MESSAGE = "spec.ddp.backend: nccl needs one GPU per rank"


def no_gpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "TORCHELASTIC_"))}
    env.pop("RANK", None)
    env.update(CUDA_VISIBLE_DEVICES="", KUBETRAIN_METRICS_PORT="0", **extra)
    return env


@pytest.mark.parametrize(
    "torchrun_env, expected",
    [
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, MESSAGE),
        ({}, "python -m kubetrain.trainer ddp runs under torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK"),
    ],
    ids=["nccl without a GPU", "outside torchrun"],
)
def test_rank_refuses_with_exit_2_and_names_the_cause(torchrun_env, expected, tmp_path):
    job = write_job(tmp_path, ddp={"nodes": 1, "backend": "nccl"})
    env = no_gpu_env(KUBETRAIN_JOB_FILE=str(job), KUBETRAIN_RUN_DIR=str(tmp_path / "run"), **torchrun_env)
    done = subprocess.run([sys.executable, "-m", "kubetrain.trainer", "ddp"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_gpu_check_script_passes_the_ranks_exit_2_through_torchrun(tmp_path):
    done = subprocess.run([str(REPO / "hack" / "gpu" / "ddp_nccl_check.sh"), str(tmp_path)],
                          env=no_gpu_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    assert MESSAGE in done.stderr
