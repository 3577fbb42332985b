"""What kubetrain reads back from a volume or a bucket is untrusted (issue 52): a writer of the storage, who can
rewrite a commit's lengths and digests too, can make a job fall back or fail, never run code, write or read
outside the folder, or destroy another job's state. Each test is a reproduction the issue reported."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from objstorelib import tree
from kubetrain.api.identity import JobIdentity
from kubetrain.trainer import dcp_reader, sharded
from kubetrain.trainer.errors import ConfigError, LoadError
from kubetrain.trainer.object_checkpoints import (ObjectCheckpoints, ObjectCheckpointStore, ObjectCommit,
                                                  ObjectShardedStore, Owner, claim, mirror)
from kubetrain.trainer.objstore import CorruptObject, ObjectURI
from kubetrain.trainer.sharded import COMMIT, ShardedStore
from kubetrain.trainer.shards import BadShard, read_npz


class Marker:
    """A pickle that, unpickled by anything that trusts it, writes a marker file: proof that code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(16, 8, generator=g)}, "step": step}


def template() -> dict:
    return {"model": {"w": torch.zeros(16, 8)}, "step": 0}


def rewrite_commit(directory: Path, name: str, data: bytes) -> None:
    """Replace `name` in a volume's sharded checkpoint and its COMMIT entry, as any writer of the claim can."""
    (directory / name).write_bytes(data)
    commit = json.loads((directory / COMMIT).read_text())
    commit["files"][name] = {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / COMMIT).write_text(json.dumps(commit))


def evil_metadata(marker: Path) -> bytes:
    return pickle.dumps(Marker(marker))


# --- a checkpoint's .metadata runs nothing ---------------------------------------------------------------------


def test_a_pickled_metadata_on_a_volume_runs_nothing_and_the_restore_falls_back(tmp_path):
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    for step in (10, 20):
        store.save(step, state(step))
        store.wait()
    marker = tmp_path / "ran"
    rewrite_commit(tmp_path / "ckpt" / "sharded-00000020", ".metadata", evil_metadata(marker))
    restarted = ShardedStore(tmp_path / "ckpt", 3, "h")
    step, path = restarted.newest()
    into = template()
    restarted.load(path, into)
    assert not marker.exists()
    assert step == 10 and into["step"] == 10 and torch.equal(into["model"]["w"], state(10)["model"]["w"])
    assert (tmp_path / "ckpt" / "sharded-00000020.corrupt").is_dir()  # kept, set aside
    [(where, why)] = restarted.set_aside_log
    assert where.endswith("sharded-00000020") and "names io.open" in why and "could run code" in why


def test_verify_and_export_of_a_pickled_metadata_run_nothing(tmp_path):
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    store.save(10, state(10))
    store.wait()
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt" / "sharded-00000010"
    rewrite_commit(path, ".metadata", evil_metadata(marker))
    with pytest.raises(sharded.CorruptSharded, match="could run code"):
        sharded.check(path)
    with pytest.raises(dcp_reader.MetadataError):
        sharded.load_whole(path)
    assert not marker.exists()


def test_a_value_pickled_into_a_shard_runs_nothing_and_the_restore_falls_back(tmp_path):
    """DCP loads a state's non-tensor values with torch.load(weights_only=False): a shard whose value for
    `step` is rewritten to a pickle that names a function is set aside at the check."""
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    for step in (10, 20):
        store.save(step, state(step))
        store.wait()
    path = tmp_path / "ckpt" / "sharded-00000020"
    reader = dcp_reader.Reader(path, sharded.Commit.read(path).lengths)
    metadata = reader.read_metadata()
    [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "step"]
    marker = tmp_path / "ran"
    evil = io.BytesIO()
    torch.save(Marker(marker), evil)
    evil_bytes = evil.getvalue()
    data = (path / info.relative_path).read_bytes()
    # The shard rewritten with the value swapped, and .metadata pointed at it, as a writer of the claim could.
    shard = data + evil_bytes
    info.offset, info.length = len(data), len(evil_bytes)
    rewrite_commit(path, info.relative_path, shard)
    rewrite_commit(path, ".metadata", pickle.dumps(metadata))
    restarted = ShardedStore(tmp_path / "ckpt", 3, "h")
    step, found = restarted.newest()
    assert step == 10 and not marker.exists()
    assert "does not load as plain data" in restarted.set_aside_log[0][1]


def test_a_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    store.save(10, state(10))
    store.wait()
    path = tmp_path / "ckpt" / "sharded-00000010"
    (tmp_path / "secret").write_bytes(b"x" * 4096)
    metadata = dcp_reader.Reader(path, sharded.Commit.read(path).lengths).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret"
    rewrite_commit(path, ".metadata", pickle.dumps(metadata))
    with pytest.raises(sharded.CorruptSharded, match="not one of the checkpoint's files"):
        sharded.check(path)


def test_a_metadata_declaring_tensors_larger_than_the_files_is_refused_before_any_allocation(tmp_path):
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    store.save(10, state(10))
    store.wait()
    path = tmp_path / "ckpt" / "sharded-00000010"
    metadata = dcp_reader.Reader(path, sharded.Commit.read(path).lengths).read_metadata()
    metadata.state_dict_metadata["model.w"].size = torch.Size([1 << 20, 1 << 20])
    rewrite_commit(path, ".metadata", pickle.dumps(metadata))
    with pytest.raises(sharded.CorruptSharded, match="more than the .* bytes of the checkpoint's files"):
        sharded.check(path)


def test_a_pickled_metadata_in_a_bucket_runs_nothing_and_the_restore_falls_back(tmp_path, s3, bucket):
    prefix = ObjectURI(bucket, "job/ddp-0/")
    store = ObjectShardedStore(tmp_path / "stage", prefix, 3, "h", store=s3.store())
    for step in (10, 20):
        store.save(step, state(step))
        store.wait()
    client = s3.store()
    marker = tmp_path / "ran"
    remote = ObjectCheckpoints(prefix, client)
    newest = remote.commits(sharded=True)[-1]
    evil = evil_metadata(marker)
    key = newest.folder + ".metadata"
    client.put_bytes(remote.uri(key), evil)
    objects = dict(newest.objects)
    objects[key] = (len(evil), hashlib.sha256(evil).hexdigest())
    remote.commit(ObjectCommit(newest.name, newest.written, objects, newest.world_size))
    mirrored = mirror(prefix, tmp_path / "copy", client)  # what `kubetrain checkpoints verify s3://...` reads
    with pytest.raises(sharded.CorruptSharded, match="could run code"):
        sharded.check(mirrored / "checkpoints" / "ddp-0" / "sharded-00000020")
    restarted = ObjectShardedStore(tmp_path / "node2", prefix, 3, "h", store=client)
    step, checkpoint = restarted.newest()
    into = template()
    restarted.load(checkpoint, into)
    assert step == 10 and into["step"] == 10 and not marker.exists()
    assert "commits/sharded-00000020.json.corrupt" in tree(client, prefix)


# --- a key writes nowhere outside ------------------------------------------------------------------------------


def test_a_commit_naming_an_absolute_key_is_refused_and_a_mirror_writes_nothing_outside(tmp_path, s3, bucket):
    prefix = ObjectURI(bucket, "job/ddp-0/")
    store = ObjectShardedStore(tmp_path / "stage", prefix, 3, "h", store=s3.store())
    store.save(10, state(10))
    store.wait()
    client = s3.store()
    remote = ObjectCheckpoints(prefix, client)
    [commit] = remote.commits(sharded=True)
    planted = tmp_path / "home" / "planted"
    key = f"{commit.folder}/{planted}"  # <folder>//<absolute path>: Path(folder) / name would drop the folder
    client.put_bytes(remote.uri(key), b"owned")
    objects = {**commit.objects, key: (5, hashlib.sha256(b"owned").hexdigest())}
    raw = ObjectCommit(commit.name, commit.written, objects, commit.world_size).to_json()
    with pytest.raises(CorruptObject, match="not an object of"):
        ObjectCommit.from_json(raw, "test")
    client.put_bytes(remote.uri("commits/sharded-00000010.json"), raw)
    mirror(prefix, tmp_path / "copy", client)
    assert not planted.exists()


@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/b", "", "..", "x\0y"])
def test_a_volume_commit_listing_a_name_that_is_not_plain_is_refused(tmp_path, name):
    store = ShardedStore(tmp_path / "ckpt", 3, "h")
    store.save(10, state(10))
    store.wait()
    path = tmp_path / "ckpt" / "sharded-00000010"
    commit = json.loads((path / COMMIT).read_text())
    commit["files"][name] = {"length": 1, "sha256": "0" * 64}
    (path / COMMIT).write_text(json.dumps(commit))
    with pytest.raises(sharded.CorruptSharded, match="not a plain file name"):
        sharded.Commit.read(path)


# --- a job never destroys another's state ----------------------------------------------------------------------


def test_a_job_on_another_jobs_prefix_is_refused_with_nothing_deleted(tmp_path, s3, bucket):
    client = s3.store()
    root = ObjectURI(bucket, "shared/")
    theirs = JobIdentity("theirs")
    claim(root, Owner("team-a", "theirs"), theirs, writer=True, store=client)
    writer = ObjectCheckpointStore(tmp_path / "a", root.child("single-0/"), 3, theirs, store=client)
    writer.save(10, state(10))
    writer.wait()
    # Their upload in flight: an object no commit names yet.
    client.put_bytes(root.child("single-0/ckpt-00000020-abcd.pt"), b"half")
    before = tree(client, root)
    with pytest.raises(ConfigError, match="holds job team-a/theirs's checkpoints .* nothing there was touched"):
        claim(root, Owner("team-b", "mine"), JobIdentity("mine"), writer=True, store=client)
    # Without the owner check too (a prefix of 0.1.0, no owner.json): the spec is judged before any cleanup.
    client.delete([root.child("owner.json")])
    mine = ObjectCheckpointStore(tmp_path / "b", root.child("single-0/"), 3, JobIdentity("mine"), store=client)
    with pytest.raises(ConfigError, match="different spec"):
        mine.load_latest()
    assert tree(client, root) == {k: v for k, v in before.items() if k != "owner.json"}


def test_only_the_prefixs_writer_cleans_what_a_kill_left(tmp_path, s3, bucket):
    client = s3.store()
    prefix = ObjectURI(bucket, "job/ddp-0/")
    writer = ObjectCheckpointStore(tmp_path / "w", prefix, 3, "h", store=client)
    writer.save(10, state(10))
    writer.wait()
    client.put_bytes(prefix.child("ckpt-00000020-abcd.pt"), b"in flight")
    reader = ObjectCheckpointStore(tmp_path / "r", prefix, 3, "h", store=client, writer=False)
    assert reader.load_latest()[0] == 10
    assert "ckpt-00000020-abcd.pt" in tree(client, prefix)  # a reader on another node leaves it
    assert writer.load_latest()[0] == 10
    assert "ckpt-00000020-abcd.pt" not in tree(client, prefix)  # the writer's own leftover, removed


# --- one missing object is a fall-back, not the end ------------------------------------------------------------


def test_a_missing_object_sets_its_checkpoint_aside_and_the_previous_one_is_used(tmp_path, s3, bucket):
    client = s3.store()
    prefix = ObjectURI(bucket, "job/single-0/")
    store = ObjectCheckpointStore(tmp_path / "local", prefix, 3, "h", store=client)
    for step in (10, 20):
        store.save(step, state(step))
    store.wait()
    newest = next(k for k in tree(client, prefix) if k.startswith("ckpt-00000020-"))
    client.delete([prefix.child(newest)])  # a lifecycle rule, a manual delete
    step, restored = ObjectCheckpointStore(tmp_path / "fresh", prefix, 3, "h", store=client).load_latest()
    assert step == 10 and torch.equal(restored["model"]["w"], state(10)["model"]["w"])
    assert "commits/ckpt-00000020.pt.json.corrupt" in tree(client, prefix)


# --- bounds on what is read ------------------------------------------------------------------------------------


def bomb(path: Path, inflated: int) -> None:
    """An .npz whose y.npy declares 8 int64 labels and inflates to `inflated` bytes."""
    x = np.zeros((8, 2), dtype=np.float32)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<i8", "fortran_order": False, "shape": (8,)})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, x)
        z.writestr("x.npy", buf.getvalue())
        z.writestr("y.npy", head.getvalue() + b"\0" * inflated)


def test_a_shard_bomb_is_refused_within_its_declared_size(tmp_path):
    path = tmp_path / "bomb.npz"
    bomb(path, 256 << 20)
    assert path.stat().st_size < 1 << 20
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BadShard, match="inflates past the .* bytes its header declares"):
        read_npz(path)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10  # never near the 256 MiB it would inflate to


def test_a_shard_whose_header_declares_more_than_its_bytes_can_hold_is_refused_before_inflating(tmp_path):
    path = tmp_path / "liar.npz"
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", head.getvalue() + b"\0" * 64)
        z.writestr("y.npy", head.getvalue() + b"\0" * 64)
    with pytest.raises(BadShard, match="more than its .* compressed bytes can hold"):
        read_npz(path)


def test_an_honest_npz_reads_as_numpy_wrote_it(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(100, 7)).astype(np.float32), np.arange(100)
    np.savez_compressed(tmp_path / "a.npz", x=x, y=y)
    np.savez(tmp_path / "b.npz", x=x, y=y)
    for name in ("a.npz", "b.npz"):
        got_x, got_y = read_npz(tmp_path / name)
        assert np.array_equal(got_x, x) and np.array_equal(got_y, y) and got_x.flags.writeable


def test_metadata_unpickling_refuses_every_global_outside_dcps_own():
    for evil in (pickle.dumps(os.system), pickle.dumps(Marker(Path("/nonexistent"))), pickle.dumps({1, 2}.__class__),
                 b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94."):
        with pytest.raises(dcp_reader.MetadataError):
            dcp_reader.read_metadata(evil, {"__0_0.distcp": 10})
    with pytest.raises(dcp_reader.MetadataError, match="does not unpickle"):
        dcp_reader.read_metadata(b"\x80\x04garbage", {})
    with pytest.raises(dcp_reader.MetadataError, match="not DCP's Metadata"):
        dcp_reader.read_metadata(pickle.dumps({"a": 1}), {})


def test_an_enum_member_pickled_by_name_reads_and_getattr_reaches_nothing_else():
    """Python 3.12 (and the trainer image's Debian 3.11) pickle DCP's `_MEM_FORMAT_ENCODING` members as
    `getattr(cls, name)`: that one lookup is allowed, for that enum's members only."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def by_name(name: str) -> bytes:
        class ByName(pickle.Pickler):
            def reducer_override(self, obj):
                if isinstance(obj, _MEM_FORMAT_ENCODING):
                    return getattr, (type(obj), name)
                return NotImplemented

        out = io.BytesIO()
        ByName(out, protocol=4).dump([_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT])
        return out.getvalue()

    member = _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    assert dcp_reader._Unpickler(io.BytesIO(by_name(member.name))).load() == [member]
    for name in ("__class__", "_member_map_", "__init__"):
        with pytest.raises(dcp_reader.MetadataError, match="not a member of DCP's metadata enums"):
            dcp_reader._Unpickler(io.BytesIO(by_name(name))).load()
