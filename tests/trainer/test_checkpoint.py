"""Checkpoints are atomic, pruned to keepLast, survive a torn newest file, and refuse another spec."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kubetrain.api import from_spec_dict
from kubetrain.api.identity import spec_hash
from kubetrain.trainer.checkpoint import CheckpointStore, capture_rng_state, restore_rng_state
from kubetrain.trainer.errors import ConfigError, TransientError


def state(step: int) -> dict:
    return {"weights": torch.full((4, 4), float(step)), "step": step, "nested": {"list": [torch.ones(2) * step]}}


def test_save_writes_a_verified_file_then_the_latest_pointer(tmp_path: Path) -> None:
    persisted = []
    store = CheckpointStore(tmp_path, keep_last=3, identity="h", on_persisted=lambda info, s: persisted.append(info))
    store.save(7, state(7))
    store.wait()
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["ckpt-00000007.pt", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000007.pt"
    assert store.latest_step() == 7
    assert [(i.step, i.path.name) for i in persisted] == [(7, "ckpt-00000007.pt")]
    step, loaded = store.load_latest()
    assert step == 7 and torch.equal(loaded["weights"], state(7)["weights"])
    assert torch.equal(loaded["nested"]["list"][0], torch.ones(2) * 7)


def test_save_snapshots_state_before_returning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3, identity="h")
    weights = torch.zeros(1000)
    store.save(1, {"weights": weights})
    weights += 1  # the training loop moves on while the file is written
    store.wait()
    assert float(store.load_latest()[1]["weights"].sum()) == 0.0


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2, identity="h")
    for step in (10, 20, 30, 40):
        store.save(step, state(step))
    store.wait()
    assert [i.step for i in store.list()] == [30, 40]


def test_temporary_files_of_a_killed_writer_are_removed_at_the_restore_and_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3, identity="h")
    store.save(10, state(10))
    store.wait()
    (tmp_path / ".ckpt-00000020.pt.tmp").write_bytes(b"half a checkpoint")
    reopened = CheckpointStore(tmp_path, keep_last=3, identity="h")
    assert reopened.load_latest()[0] == 10
    assert not (tmp_path / ".ckpt-00000020.pt.tmp").exists()


def test_a_directory_of_another_jobs_checkpoints_is_refused_with_nothing_removed(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, keep_last=3, identity="theirs", background=False).save(10, state(10))
    (tmp_path / ".ckpt-00000020.pt.tmp").write_bytes(b"their write in flight")
    with pytest.raises(ConfigError, match="different spec"):
        CheckpointStore(tmp_path, keep_last=3, identity="mine").load_latest()
    assert (tmp_path / ".ckpt-00000020.pt.tmp").read_bytes() == b"their write in flight"
    assert (tmp_path / "ckpt-00000010.pt").is_file()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), id="flipped byte"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: data[:20], id="torn header"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage
) -> None:
    store = CheckpointStore(tmp_path, keep_last=3, identity="h", background=False)
    store.save(10, state(10))
    store.save(20, state(20))
    newest = tmp_path / "ckpt-00000020.pt"
    newest.write_bytes(damage(newest.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="kubetrain.trainer.checkpoint"):
        step, loaded = store.load_latest()
    assert step == 10 and float(loaded["weights"][0, 0]) == 10.0
    assert "ckpt-00000020.pt" in caplog.text and "falling back" in caplog.text
    assert [i.step for i in store.list()] == [10], "the damaged file is set aside"


def test_no_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "new", keep_last=3, identity="h")
    assert store.load_latest() is None and store.latest_step() is None


def test_a_checkpoint_of_another_spec_is_refused(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, keep_last=3, identity="aaaa", background=False).save(5, state(5))
    with pytest.raises(ConfigError, match=r"different spec: its hash is aaaa, this store's bbbb"):
        CheckpointStore(tmp_path, keep_last=3, identity="bbbb").load_latest()


def test_a_failed_write_surfaces_as_transient_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep_last=3, identity="h")
    (tmp_path / "ckpt").rmdir()
    (tmp_path / "ckpt").write_text("a file where the directory was")
    store.save(1, state(1))
    with pytest.raises(TransientError, match="could not be written"):
        store.wait()


def spec(**training) -> object:
    doc = {"mode": "Single", "training": {"seed": 0, **training}}
    return from_spec_dict("job", doc).spec


@pytest.mark.parametrize(
    "change, same",
    [
        ({"epochs": 20}, True),
        ({"device": "cpu"}, True),
        ({"seed": 1}, False),
        ({"batchSize": 32}, False),
        ({"optimizer": {"learningRate": 0.1}}, False),
    ],
    ids=["epochs", "device", "seed", "batchSize", "learningRate"],
)
def test_spec_hash_follows_the_fields_that_change_the_math(change: dict, same: bool) -> None:
    assert (spec_hash(spec(**change)) == spec_hash(spec())) is same


def test_rng_states_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    store = CheckpointStore(tmp_path, keep_last=1, identity="h", background=False)
    store.save(1, {"rng": capture_rng_state()})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(store.load_latest()[1]["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_a_payload_that_hashes_right_but_does_not_load_is_set_aside(tmp_path: Path) -> None:
    import hashlib
    import json

    from kubetrain.trainer.checkpoint import MAGIC

    store = CheckpointStore(tmp_path, keep_last=3, identity="h", background=False)
    store.save(10, state(10))
    payload = b"not a torch file at all"
    header = {"step": 20, "spec_hash": "h", "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (tmp_path / "ckpt-00000020.pt").write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
    step, _ = store.load_latest()
    assert step == 10
    assert (tmp_path / "ckpt-00000020.pt.corrupt").exists()


def test_a_fifo_or_a_symlink_named_like_a_checkpoint_is_skipped(tmp_path: Path, caplog) -> None:
    import os

    store = CheckpointStore(tmp_path, keep_last=3, identity="h", background=False)
    store.save(10, state(10))
    os.mkfifo(tmp_path / "ckpt-00000030.pt")  # reading it would block the start for ever
    elsewhere = tmp_path.parent / f"{tmp_path.name}-outside.pt"
    CheckpointStore(tmp_path.parent / "other", keep_last=3, identity="h", background=False).save(40, state(40))
    elsewhere.write_bytes((tmp_path.parent / "other" / "ckpt-00000040.pt").read_bytes())
    (tmp_path / "ckpt-00000040.pt").symlink_to(elsewhere)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    with caplog.at_level(logging.WARNING, logger="kubetrain.trainer.checkpoint"):
        assert [i.step for i in store.list()] == [10]
        step, _ = store.load_latest()
        assert store.latest_step() is None
    assert step == 10
    assert "not a regular file" in caplog.text and "pointer" in caplog.text


@pytest.mark.parametrize("mode, change, same", [
    ("ParameterServer", {"replicas": 3}, True),
    ("ParameterServer", {"parameterServer": {"workers": 5}}, True),
    ("ParameterServer", {"parameterServer": {"replicas": 2}}, False),
    ("DDP", {"replicas": 1, "ddp": {"nodes": 2, "minNodes": 1}}, True),
    ("DDP", {"ddp": {"procsPerNode": 2}}, False),
], ids=["spec.replicas", "workers", "shards", "ddp nodes", "procsPerNode"])
def test_the_jobs_size_is_not_part_of_the_hash_an_elastic_job_resumes_at_another(mode, change, same) -> None:
    base = from_spec_dict("job", {"mode": mode}).spec
    assert (spec_hash(from_spec_dict("job", {"mode": mode, **change}).spec) == spec_hash(base)) is same
