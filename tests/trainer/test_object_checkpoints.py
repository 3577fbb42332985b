"""Checkpoints in object storage (kubetrain/trainer/object_checkpoints.py) against a real S3 server: a checkpoint exists
once its commit does, the newest is resolved from commits alone, damaged ones are set aside, and whatever a
kill leaves (objects without a commit, a multipart upload never completed) is never restored and is cleaned."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from objstorelib import tree
from kubetrain.shared.checkpoints import LATEST
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.object_checkpoints import ObjectCheckpointStore, ObjectShardedStore
from kubetrain.trainer.objstore import MULTIPART_BYTES, ObjectURI


def state(step: int, size: int = 64) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(size, 32, generator=g)}, "step": step}


def template(size: int = 64) -> dict:
    return {"model": {"w": torch.zeros(size, 32)}, "step": 0}


def plain(tmp_path, s3, bucket, keep_last=3, spec="h", **kw) -> ObjectCheckpointStore:
    return ObjectCheckpointStore(tmp_path / "local", ObjectURI(bucket, "job/single-0/"), keep_last, spec,
                                 store=s3.store(), **kw)


def test_a_checkpoint_is_reported_only_once_its_commit_names_every_object_with_its_sha256(tmp_path, s3, bucket):
    reported = []
    store = plain(tmp_path, s3, bucket, on_persisted=lambda info, seconds: reported.append(info))
    for step in (10, 20, 30, 40):
        store.save(step, state(step))
    store.wait()
    objects = tree(store.remote.store, ObjectURI(bucket, "job/single-0/"))
    commits = sorted(k for k in objects if k.startswith("commits/"))
    # keepLast 3: the oldest commit and its object are gone, nothing else is left.
    assert commits == ["commits/ckpt-00000020.pt.json", "commits/ckpt-00000030.pt.json",
                       "commits/ckpt-00000040.pt.json"]
    assert len([k for k in objects if k.startswith("ckpt-")]) == 3
    commit = json.loads(store.remote.store.get_bytes(ObjectURI(bucket, "job/single-0/commits/ckpt-00000040.pt.json")))
    [(key, entry)] = commit["objects"].items()
    assert key.startswith("ckpt-00000040-") and objects[key] == entry["length"]
    assert store.remote.store.digest(ObjectURI(bucket, f"job/single-0/{key}")) == (entry["length"], entry["sha256"])
    assert [(i.step, i.uri.endswith(key) if i.step == 40 else True) for i in reported] == \
        [(10, True), (20, True), (30, True), (40, True)]
    # The local directory: `latest` and the newest file only (a cache for a restart on this node).
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["ckpt-00000040.pt", LATEST]


def test_a_restore_takes_the_newest_commit_and_downloads_only_what_it_lacks(tmp_path, s3, bucket):
    store = plain(tmp_path, s3, bucket)
    store.save(10, state(10))
    store.save(20, state(20))
    store.wait()
    again = plain(tmp_path, s3, bucket)
    step, restored = again.load_latest()
    assert step == 20 and torch.equal(restored["model"]["w"], state(20)["model"]["w"])
    assert again.remote.store.stats.downloaded_bytes < 4096  # the local copy is the commit's bytes: commits only
    # On another node (no local copy) the object is downloaded and checked.
    elsewhere = ObjectCheckpointStore(tmp_path / "other", ObjectURI(bucket, "job/single-0/"), 3, "h", store=s3.store())
    step, restored = elsewhere.load_latest()
    assert step == 20 and torch.equal(restored["model"]["w"], state(20)["model"]["w"])
    assert (tmp_path / "other" / LATEST).read_text() == "ckpt-00000020.pt\n"


def test_a_damaged_object_sets_its_commit_aside_and_the_previous_one_is_used(tmp_path, s3, bucket):
    store = plain(tmp_path, s3, bucket)
    store.save(10, state(10))
    store.save(20, state(20))
    store.wait()
    objects = tree(store.remote.store, ObjectURI(bucket, "job/single-0/"))
    newest = next(k for k in objects if k.startswith("ckpt-00000020-"))
    store.remote.store.put_bytes(ObjectURI(bucket, f"job/single-0/{newest}"), b"bit rot")
    elsewhere = ObjectCheckpointStore(tmp_path / "other", ObjectURI(bucket, "job/single-0/"), 3, "h", store=s3.store())
    step, _ = elsewhere.load_latest()
    assert step == 10
    after = tree(store.remote.store, ObjectURI(bucket, "job/single-0/"))
    assert "commits/ckpt-00000020.pt.json.corrupt" in after and "commits/ckpt-00000020.pt.json" not in after
    assert elsewhere.load_latest()[0] == 10  # and stays so
    # Set aside, never deleted: the damaged object stays for a person to look at, through later cleanups too.
    assert tree(store.remote.store, ObjectURI(bucket, "job/single-0/"))[newest] == len(b"bit rot")
    assert elsewhere.set_aside_log and "sha256" in elsewhere.set_aside_log[0][1]


def test_a_checkpoint_of_another_spec_is_refused(tmp_path, s3, bucket):
    store = plain(tmp_path, s3, bucket, spec="one")
    store.save(10, state(10))
    store.wait()
    with pytest.raises(ConfigError, match="written for a different spec"):
        plain(tmp_path / "x", s3, bucket, spec="two").load_latest()


def test_leftovers_of_a_writer_killed_mid_upload_go_at_the_next_start(tmp_path, s3, bucket):
    store = plain(tmp_path, s3, bucket)
    store.save(10, state(10))
    store.wait()
    client = store.remote.store
    prefix = ObjectURI(bucket, "job/single-0/")
    client.put_bytes(prefix.child("ckpt-00000020-0badcafe.pt"), b"half of what it would have been")
    client.request("POST", prefix.child("ckpt-00000030-0c0ffee0.pt"), {"uploads": ""})
    assert plain(tmp_path, s3, bucket).load_latest()[0] == 10
    left = tree(client, prefix)
    assert {k.split("-", 2)[1] if k.startswith("ckpt-") else k for k in left} == {"00000010",
                                                                                 "commits/ckpt-00000010.pt.json"}
    assert len(left) == 2
    assert client.abort_incomplete(prefix) == 0  # aborted by the start already


KILLED_MID_UPLOAD = """
import os, signal, sys, torch
from kubetrain.trainer.object_checkpoints import ObjectCheckpointStore
from kubetrain.trainer.objstore import ObjectURI
store = ObjectCheckpointStore(sys.argv[1], ObjectURI(sys.argv[2], "job/single-0/"), 3, "h",
                              mid_save=lambda step: step == 20 and os.kill(os.getpid(), signal.SIGKILL))
big = {"w": torch.ones(%d)}
store.save(10, big)
store.wait()
store.save(20, {"w": torch.full_like(big["w"], 2.0)})
store.wait()
print("not killed")
"""


def test_a_replica_killed_mid_upload_resumes_from_the_commit_before(tmp_path, s3, bucket):
    floats = (MULTIPART_BYTES + (8 << 20)) // 4  # past the multipart threshold: several parts, half sent
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_UPLOAD % floats, str(tmp_path / "local"), bucket],
                          env=s3.environ(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    prefix = ObjectURI(bucket, "job/single-0/")
    client = s3.store()
    assert [k for k in tree(client, prefix) if k.startswith("commits/")] == ["commits/ckpt-00000010.pt.json"]
    # The kill left step 20's multipart upload open (invisible to a listing), and the local `latest` at 10.
    answer = client.request("GET", prefix, {"uploads": "", "prefix": prefix.key}, bucket_only=True)
    assert b"ckpt-00000020-" in answer.body
    assert (tmp_path / "local" / LATEST).read_text() == "ckpt-00000010.pt\n"
    step, restored = plain(tmp_path, s3, bucket).load_latest()
    assert step == 10 and torch.equal(restored["w"], torch.ones(floats))
    assert client.abort_incomplete(prefix) == 0
    assert not [k for k in tree(client, prefix) if k.startswith("ckpt-00000020")]


def sharded(tmp_path, s3, bucket, keep_last=3, **kw) -> ObjectShardedStore:
    return ObjectShardedStore(tmp_path / "stage", ObjectURI(bucket, "job/ddp-0/"), keep_last, "h", store=s3.store(), **kw)


def test_a_sharded_save_uploads_its_files_commits_once_and_loads_from_ranged_reads(tmp_path, s3, bucket):
    reported = []
    store = sharded(tmp_path, s3, bucket, keep_last=2, on_persisted=lambda info, s: reported.append(info.step))
    for step in (10, 20, 30):
        store.save(step, state(step, size=256))
        store.wait()
    prefix = ObjectURI(bucket, "job/ddp-0/")
    objects = tree(s3.store(), prefix)
    assert sorted(k for k in objects if k.startswith("commits/")) == ["commits/sharded-00000020.json",
                                                                      "commits/sharded-00000030.json"]
    assert {k.split("/", 1)[1] for k in objects if k.startswith("sharded-00000030-")} == {".metadata", "__0_0.distcp"}
    assert not [k for k in objects if k.startswith("sharded-00000010-")]
    assert reported == [10, 20, 30]
    assert not [p for p in (tmp_path / "stage").iterdir() if p.name != LATEST]  # the staging went after the upload
    fresh = sharded(tmp_path / "node2", s3, bucket)
    step, commit = fresh.newest()
    into = template(size=256)
    fresh.load(commit, into)
    assert step == 30 and torch.equal(into["model"]["w"], state(30, size=256)["model"]["w"]) and into["step"] == 30


def test_a_damaged_sharded_object_sets_the_checkpoint_aside(tmp_path, s3, bucket):
    store = sharded(tmp_path, s3, bucket)
    for step in (10, 20):
        store.save(step, state(step))
        store.wait()
    prefix = ObjectURI(bucket, "job/ddp-0/")
    shard = next(k for k in tree(s3.store(), prefix) if k.startswith("sharded-00000020-") and k.endswith(".distcp"))
    s3.store().put_bytes(prefix.child(shard), b"torn")
    step, commit = sharded(tmp_path / "node2", s3, bucket).newest()
    assert step == 10
    assert "commits/sharded-00000020.json.corrupt" in tree(s3.store(), prefix)


def test_a_sharded_save_that_never_committed_is_never_restored_and_goes_at_the_next_start(tmp_path, s3, bucket):
    store = sharded(tmp_path, s3, bucket)
    store.save(10, state(10))
    store.wait()
    prefix = ObjectURI(bucket, "job/ddp-0/")
    s3.store().put_bytes(prefix.child("sharded-00000020-5eed/__0_0.distcp"), b"a rank's upload, no commit")
    step, _ = sharded(tmp_path / "node2", s3, bucket).newest()
    assert step == 10
    assert not [k for k in tree(s3.store(), prefix) if k.startswith("sharded-00000020")]



def test_a_hash_only_checkpoint_of_0_1_0_under_a_changed_spec_is_refused_naming_the_fields(tmp_path, s3, bucket):
    """A prefix an earlier release wrote holds commits with a hash only; the job.yaml its first writer left beside
    them says which fields the job changed since."""
    import yaml

    from kubetrain.api import from_spec_dict
    from kubetrain.api.identity import JobIdentity, spec_hash
    from kubetrain.trainer.object_checkpoints import write_job

    doc = {"mode": "Single", "model": {"name": "mlp", "args": {"hidden": 32}},
           "training": {"optimizer": {"learningRate": 0.05}}}
    old = from_spec_dict("job", doc).spec
    client = s3.store()
    root = ObjectURI(bucket, "old/")
    write_job(root, yaml.safe_dump({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                                    "metadata": {"name": "job"}, "spec": doc}).encode(), client)
    written = ObjectCheckpointStore(tmp_path / "a", root.child("single-0/"), 3, spec_hash(old), store=client)
    written.save(10, state(10))  # a bare hash: what 0.1.0 wrote, no identity
    written.wait()
    changed = from_spec_dict("job", {**doc, "training": {"optimizer": {"learningRate": 0.1}}}).spec
    with pytest.raises(ConfigError, match=r"the manifest it was written with differs: "
                                          r"training.optimizer.learningRate: 0.05 in the checkpoint, 0.1 in this job"):
        ObjectCheckpointStore(tmp_path / "b", root.child("single-0/"), 3, JobIdentity.of(changed),
                              store=client).load_latest()
    same = ObjectCheckpointStore(tmp_path / "c", root.child("single-0/"), 3, JobIdentity.of(old), store=client)
    assert same.load_latest()[0] == 10
