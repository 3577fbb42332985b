"""kubetrain.shared.checkpoints: the layout the trainer writes is the one the supervisor reads."""

import os

import pytest
import torch

from kubetrain.shared.checkpoints import (LATEST, RUN_CHECKPOINTS, file_name, latest_step, read_latest,
                                            replica_dir, replica_dirs, sharded_name, sharded_tmp_name, step_of)
from kubetrain.trainer.checkpoint import CheckpointStore


@pytest.mark.parametrize("name,step", [
    (file_name(12), 12), ("ckpt-00000012.pt", 12), (sharded_name(7), 7), ("sharded-00000007", 7),
    ("ckpt-12.pt", None), ("sharded-00000007.corrupt", None), (sharded_tmp_name(7, "ab12"), None),
    (".ckpt-00000012.pt.1.ab.tmp", None), ("latest", None), ("", None),
], ids=lambda v: repr(v))
def test_step_of_names_only_checkpoints(name, step):
    assert step_of(name) == step


def test_the_supervisor_reads_the_step_the_trainer_wrote(tmp_path):
    assert latest_step(tmp_path) is None  # no checkpoint yet
    store = CheckpointStore(tmp_path, keep_last=2, identity="h", background=False)
    store.save(30, {"w": torch.zeros(3)})
    store.save(40, {"w": torch.ones(3)})
    assert (read_latest(tmp_path), latest_step(tmp_path)) == (file_name(40), 40)
    assert store.latest_step() == 40


def test_a_sharded_pointer_names_its_step(tmp_path):
    (tmp_path / LATEST).write_text(sharded_name(9) + "\n")
    assert latest_step(tmp_path) == 9


@pytest.mark.parametrize("pointer", ["garbage\n", "ckpt-9.pt\n", "x" * 10_000])
def test_a_pointer_that_names_no_checkpoint_gives_no_step(tmp_path, pointer):
    (tmp_path / LATEST).write_text(pointer)
    assert latest_step(tmp_path) is None


def test_a_pointer_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text(file_name(5))
    os.symlink(tmp_path / "elsewhere", tmp_path / LATEST)
    with pytest.raises(OSError):
        latest_step(tmp_path)


def test_a_run_directory_lists_its_replicas_checkpoint_directories(tmp_path):
    assert replica_dirs(tmp_path) is None  # no checkpoints/ folder: not a run directory
    for replica in ("ps-1", "ps-0"):
        replica_dir(tmp_path, replica).mkdir(parents=True)
    (tmp_path / RUN_CHECKPOINTS / "stray-file").write_text("")
    assert replica_dirs(tmp_path) == {"ps-0": tmp_path / RUN_CHECKPOINTS / "ps-0",
                                      "ps-1": tmp_path / RUN_CHECKPOINTS / "ps-1"}
