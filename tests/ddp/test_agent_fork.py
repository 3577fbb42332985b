"""Which jobs' ranks the DDP agent forks (kubetrain/trainer/ddp/agent.py): the built-in loop's on CPUs only."""

from __future__ import annotations

import pytest
import torch

from ddp_group import write_job
from kubetrain.trainer.ddp.agent import ranks_on_cpu

CASES = [
    ("gloo on cpu", {"ddp": {"backend": "gloo"}, "training": {"device": "cpu"}}, True),
    ("nccl", {"ddp": {"backend": "nccl"}, "training": {"device": "auto"}}, False),
    ("gloo on cuda", {"ddp": {"backend": "gloo"}, "training": {"device": "cuda"}}, False),
    # auto: forked only where no GPU is visible (this machine's case when it has none).
    ("gloo on auto", {"ddp": {"backend": "gloo"}, "training": {"device": "auto"}}, torch.cuda.device_count() == 0),
]


@pytest.mark.parametrize("override,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ranks_are_forked_only_when_they_train_on_cpus(override, expected, tmp_path):
    job = write_job(tmp_path, **override)
    assert ranks_on_cpu({"KUBETRAIN_JOB_FILE": str(job)}) is expected


def test_a_job_file_that_does_not_load_is_left_to_the_rank_to_report(tmp_path):
    assert ranks_on_cpu({}) is False
    assert ranks_on_cpu({"KUBETRAIN_JOB_FILE": str(tmp_path / "missing.yaml")}) is False
    (tmp_path / "bad.yaml").write_text("kind: TrainingJob\nspec: [\n")
    assert ranks_on_cpu({"KUBETRAIN_JOB_FILE": str(tmp_path / "bad.yaml")}) is False
