"""kubetrain/trainer/sharded.py in one process (no process group: DCP's no_dist path): the commit protocol, the checks
of a restore, and the errors a script sees. The multi-rank paths run under torchrun in
tests/local/test_sharded_scripts.py and tests/ddp/test_fsdp_training.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kubetrain.trainer import sharded
from kubetrain.trainer.errors import ConfigError, TransientError
from kubetrain.shared.checkpoints import COMMIT, SHARDED_TMP_PATTERN
from kubetrain.trainer.checkpoint import Written
from kubetrain.trainer.sharded import Commit, CorruptSharded, ShardedCheckpointError, ShardedStore


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "step": seed, "meta": {"name": f"s{seed}"}}


def template() -> dict:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": 0, "meta": {"name": ""}}


def saved(directory, *steps, keep_last=3, **kw) -> ShardedStore:
    store = ShardedStore(directory, keep_last, "h", **kw)
    for step in steps:
        store.save(step, state(step))
        store.wait()
    return store


def test_a_save_is_committed_with_every_file_hashed_and_latest_moved(tmp_path):
    reported = []
    saved(tmp_path, 10, on_persisted=lambda info, seconds: reported.append((info.step, info.path.name)))
    commit = json.loads((tmp_path / "sharded-00000010" / "COMMIT").read_text())
    assert (commit["step"], commit["spec_hash"], commit["world_size"]) == (10, "h", 1)
    assert set(commit["files"]) == {".metadata", "__0_0.distcp"}
    for name, f in commit["files"].items():
        assert (tmp_path / "sharded-00000010" / name).stat().st_size == f["length"]
    assert (tmp_path / "latest").read_text() == "sharded-00000010\n"
    assert reported == [(10, "sharded-00000010")]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing temporary left


def test_keep_last_removes_whole_checkpoints(tmp_path):
    saved(tmp_path, 10, 20, 30, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("sharded-*")) == ["sharded-00000020", "sharded-00000030"]


def test_a_restore_loads_the_newest_into_the_template_in_place(tmp_path):
    store = saved(tmp_path, 10, 20)
    step, path = store.newest()
    into = template()
    store.load(path, into)
    assert step == 20 and torch.equal(into["model"]["w"], state(20)["model"]["w"])
    assert (into["step"], into["meta"]) == (20, {"name": "s20"})


def test_the_save_copies_the_state_before_returning(tmp_path):
    store = ShardedStore(tmp_path, 3, "h")
    live = state(5)
    store.save(5, live)
    live["model"]["w"].add_(1000)  # the loop goes on changing its tensors
    store.wait()
    into = template()
    store.load(store.newest()[1], into)
    assert torch.equal(into["model"]["w"], state(5)["model"]["w"])


def test_a_save_killed_before_its_commit_is_never_restored_and_goes_at_the_next_start(tmp_path):
    saved(tmp_path, 10)

    class Killed(BaseException):
        pass

    def die(step):
        raise Killed  # as a SIGKILL would: the files are written, COMMIT is not

    store = ShardedStore(tmp_path, 3, "h", mid_save=die)
    store.save(20, state(20))
    with pytest.raises(TransientError):
        store.wait()
    [unfinished] = sharded.incomplete(tmp_path)
    assert SHARDED_TMP_PATTERN.fullmatch(unfinished.name) and not (unfinished / COMMIT).exists()
    restarted = ShardedStore(tmp_path, 3, "h")
    assert restarted.newest()[0] == 10
    assert sharded.incomplete(tmp_path) == []


def test_a_damaged_file_sets_the_checkpoint_aside_and_the_previous_one_is_used(tmp_path):
    saved(tmp_path, 10, 20)
    data = tmp_path / "sharded-00000020" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    assert ShardedStore(tmp_path, 3, "h").newest()[0] == 10
    assert (tmp_path / "sharded-00000020.corrupt").is_dir()


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "COMMIT").unlink(), "no COMMIT"),
    (lambda d: (d / "COMMIT").write_text("{not json"), "COMMIT is unreadable"),
    (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda d: os.truncate(d / "__0_0.distcp", 10), "is 10 bytes, COMMIT says"),
    (lambda d: ((d / "COMMIT").rename(d / "c"), (d / "COMMIT").symlink_to(d / "c")), "a symbolic link, refused"),
    (lambda d: (d / "COMMIT").write_bytes(b" " * (sharded.MAX_COMMIT_BYTES + 1)), "larger than"),
], ids=["no commit", "bad json", "file missing", "truncated", "commit a link", "commit too large"])
def test_check_names_what_is_wrong(tmp_path, damage, words):
    saved(tmp_path, 10)
    damage(tmp_path / "sharded-00000010")
    with pytest.raises(CorruptSharded, match=words):
        sharded.check(tmp_path / "sharded-00000010")


def test_a_checkpoint_of_another_spec_is_refused(tmp_path):
    saved(tmp_path, 10)
    with pytest.raises(ConfigError, match="written for a different spec"):
        ShardedStore(tmp_path, 3, "other").newest()


def test_a_template_that_does_not_fit_is_named(tmp_path):
    store = saved(tmp_path, 10)
    wrong = template()
    wrong["model"]["extra"] = torch.zeros(3)
    with pytest.raises(ShardedCheckpointError, match="does not fit the template given: rank 0: RuntimeError: "
                                                     "Missing key in checkpoint state_dict: model.extra"):
        store.load(store.newest()[1], wrong)


def test_fill_template_copies_a_plain_state_and_names_a_mismatch():
    into = template()
    assert sharded.fill_template(into, state(3)) is into
    assert torch.equal(into["model"]["b"], state(3)["model"]["b"]) and into["meta"] == {"name": "s3"}
    with pytest.raises(ShardedCheckpointError, match=r"state\['model'\]\['w'\] has shape \(2, 2\) in the checkpoint"):
        sharded.fill_template(template(), {**state(3), "model": {"w": torch.zeros(2, 2), "b": torch.zeros(32)}})
    with pytest.raises(ShardedCheckpointError, match=r"the checkpoint has no \['meta'\]"):
        sharded.fill_template(template(), {"model": state(3)["model"], "step": 3})


def test_load_whole_gives_plain_tensors_nested_as_saved(tmp_path):
    saved(tmp_path, 10)
    whole = sharded.load_whole(tmp_path / "sharded-00000010")
    assert torch.equal(whole["model"]["w"], state(10)["model"]["w"]) and whole["meta"] == {"name": "s10"}


def test_a_commit_round_trips():
    commit = Commit(Written(7, "h"), 2, {"a": (1, "0" * 64), ".metadata": (2, "f" * 64)})
    assert json.loads(commit.to_json())["files"]["a"] == {"length": 1, "sha256": "0" * 64}
