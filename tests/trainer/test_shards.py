"""Sharded datasets (kubetrain/trainer/shards.py): shards indexed from their headers, dealt whole to the ranks, read
through a bounded cache, and a cursor that resumes at the very next sample: every sample of every epoch
trained exactly once, counted."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch

from kubetrain.api.spec import Dataset
from kubetrain.trainer.data import ShardCursor, load_data, redeal
from kubetrain.trainer.errors import LoadError
from kubetrain.trainer.objstore import ObjectURI
from kubetrain.trainer.shards import (Columns, DirectoryStorage, ObjectStorage, ShardCache, ShardOrder, build_index,
                                      eval_shards, parse_quantity)


def shard_arrays(i: int, rows: int, features: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose first feature is their global id (i * 1000 + row): what a test counts."""
    x = np.random.default_rng(i).normal(size=(rows, features)).astype(np.float32)
    x[:, 0] = i * 1000 + np.arange(rows)
    return x, (np.arange(rows) % 3).astype(np.int64)


def npz_bytes(x: np.ndarray, y: np.ndarray, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, x=x, y=y)
    return buf.getvalue()


def parquet_bytes(x: np.ndarray, y: np.ndarray) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({**{f"f{j}": x[:, j] for j in range(x.shape[1])}, "label": y})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_shards(directory, counts, kind="npz"):
    directory.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(counts):
        x, y = shard_arrays(i, rows)
        data = {"npz": lambda: npz_bytes(x, y), "npzc": lambda: npz_bytes(x, y, compressed=True),
                "parquet": lambda: parquet_bytes(x, y)}[kind]()
        (directory / f"part-{i:03d}.{'parquet' if kind == 'parquet' else 'npz'}").write_bytes(data)
    return directory


@pytest.mark.parametrize("kind", ["npz", "npzc", "parquet"])
def test_shards_are_indexed_from_their_headers_and_the_index_is_kept(tmp_path, kind):
    storage = DirectoryStorage(write_shards(tmp_path / "d", [5, 7, 3], kind), "spec.dataset.path")
    metas = build_index(storage, Columns(), tmp_path / "cache")
    assert [(m.rows, m.x_shape, m.y_max) for m in metas] == [(5, (8,), 2.0), (7, (8,), 2.0), (3, (8,), 2.0)]
    calls = []
    storage.read_range = lambda *a: calls.append(a) or b""  # a second start reads the kept index only
    assert build_index(storage, Columns(), tmp_path / "cache") == metas
    assert calls == []


def test_object_shards_are_indexed_with_a_few_ranged_reads_each(tmp_path, s3, bucket):
    store = s3.store()
    sizes = []
    for i in range(4):
        data = npz_bytes(*shard_arrays(i, 2000, features=64))
        sizes.append(len(data))
        store.put_bytes(ObjectURI(bucket, f"ds/part-{i}.npz"), data)
    before = store.stats.downloaded_bytes
    metas = build_index(ObjectStorage(ObjectURI(bucket, "ds/"), store), Columns(), None)
    assert [m.rows for m in metas] == [2000] * 4
    # Headers and the labels, not the features: a small part of each shard.
    assert store.stats.downloaded_bytes - before < sum(sizes) / 10


@pytest.mark.parametrize("lanes,counts", [(1, [10] * 4), (2, [10] * 4), (3, [7, 11, 5, 9, 13]), (4, [3, 3]),
                                          (2, [10, 30, 10])])
def test_an_epochs_order_holds_every_sample_once_whatever_the_lanes(lanes, counts):
    order = ShardOrder(counts, seed=3)
    for epoch in range(3):
        got = order.order(epoch, lanes)
        assert sorted(got.tolist()) == list(range(sum(counts)))
        assert torch.equal(got, order.order(epoch, lanes))  # the same on every process
    assert not torch.equal(order.order(0, lanes), order.order(1, lanes))


def test_each_rank_reads_only_its_own_shards():
    counts, world = [50] * 8, 4
    order = ShardOrder(counts, seed=0)
    offsets = np.cumsum([0] + counts)
    for epoch in range(3):
        touched = []
        for rank in range(world):
            cursor = ShardCursor(sum(counts), rank, world, 16, 0, order=order)
            cursor.load_state_dict({**cursor.state_dict(), "epoch": epoch})
            samples = torch.cat([cursor.next_batch() for _ in range(cursor.steps_left(epoch + 1))])
            touched.append(set(np.searchsorted(offsets, samples.numpy(), side="right") - 1))
        assert all(len(t) == len(counts) // world for t in touched)
        assert set().union(*touched) == set(range(len(counts)))  # disjoint: each shard is one rank's


def run_epochs(cursors, steps) -> Counter:
    seen = Counter()
    for _ in range(steps):
        for c in cursors:
            seen.update(c.next_batch().tolist())
    return seen


def test_a_resumed_cursor_continues_with_the_very_next_sample_and_no_sample_twice():
    counts, world, batch = [13, 29, 7, 31, 20], 2, 8
    order = ShardOrder(counts, seed=5)
    n = sum(counts)
    fresh = [ShardCursor(n, r, world, batch, 5, order=order) for r in range(world)]
    whole = [[c.next_batch().tolist() for _ in range(20)] for c in fresh]
    # A run killed after 7 steps: each rank resumes from its saved state.
    cut = [ShardCursor(n, r, world, batch, 5, order=order) for r in range(world)]
    head = [[c.next_batch().tolist() for _ in range(7)] for c in cut]
    resumed = [ShardCursor(n, r, world, batch, 5, order=order) for r in range(world)]
    for c, old in zip(resumed, cut):
        c.load_state_dict(old.state_dict())
    tail = [[c.next_batch().tolist() for _ in range(13)] for c in resumed]
    assert [h + t for h, t in zip(head, tail)] == whole
    # Counted: an epoch's samples, every rank together, each once (DDP deals n // world * world of them).
    cursors = [ShardCursor(n, r, world, batch, 5, order=order) for r in range(world)]
    per_epoch = cursors[0].steps_left(1)
    seen = run_epochs(cursors, per_epoch)
    assert max(seen.values()) == 1 and len(seen) == n // world * world


def test_a_resize_mid_epoch_keeps_the_epochs_order_and_deals_what_is_left_once():
    counts, batch = [40] * 6, 4
    order = ShardOrder(counts, seed=1)
    n = sum(counts)
    two = [ShardCursor(n, r, 2, batch, 1, order=order) for r in range(2)]
    seen = run_epochs(two, 9)
    states = redeal([c.state_dict() for c in two], 3, equal=True)
    three = [ShardCursor(n, r, 3, batch, 1, order=order) for r in range(3)]
    for c, s in zip(three, states):
        c.load_state_dict(s)
    assert all(s["plans"][str(two[0].epoch)]["lanes"] == 2 for s in states)  # the epoch's order is the 2-lane one
    while three[0].epoch == 0:
        seen += run_epochs(three, 1)
    assert max(seen.values()) == 1
    assert n - 3 < len(seen) <= n  # equal shares leave out fewer than the ranks


def test_the_cache_stays_within_its_size_and_serves_hits(tmp_path, s3, bucket):
    store = s3.store()
    for i in range(6):
        store.put_bytes(ObjectURI(bucket, f"c/part-{i}.npz"), npz_bytes(*shard_arrays(i, 500, features=32)))
    storage = ObjectStorage(ObjectURI(bucket, "c/"), store)
    metas = build_index(storage, Columns(), None)
    bound = 3 * metas[0].size + 100
    cache = ShardCache(tmp_path / "cache", bound)
    for meta in metas + metas[-2:]:
        cache.get(storage, meta)
        held = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
        assert held <= bound
    assert (cache.misses, cache.hits) == (6, 2)


def test_load_data_from_a_prefix_holds_out_whole_shards_and_reads_rows_lazily(tmp_path, s3, bucket, monkeypatch):
    monkeypatch.setenv("KUBETRAIN_DATA_CACHE_DIR", str(tmp_path / "cache"))
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store = s3.store()
    for i in range(5):
        store.put_bytes(ObjectURI(bucket, f"ds/part-{i}.npz"), npz_bytes(*shard_arrays(i, 40)))
    data = load_data(Dataset(uri=f"s3://{bucket}/ds/", eval_fraction=0.2), seed=0)
    held = eval_shards(5, 0.2, 0)
    assert len(held) == 1 and len(data.eval_x) == 40 and len(data.train_x) == 160
    assert data.input_shape == (8,) and data.num_classes == 3
    rows = torch.tensor([0, 39, 40, 159, 5])
    ids = data.train_x[rows][:, 0]
    train_shards = [i for i in range(5) if i not in held]
    expected = [train_shards[int(r) // 40] * 1000 + int(r) % 40 for r in rows]
    assert ids.tolist() == expected
    assert data.train_y[rows].dtype == torch.int64


@pytest.mark.parametrize("damage,words", [
    (b"not a zip at all", "not a zip file"),
    (npz_bytes(np.zeros((3, 2)), np.zeros(4)), "same number of samples"),
])
def test_a_corrupt_shard_fails_the_load_naming_its_uri(tmp_path, s3, bucket, monkeypatch, damage, words):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KUBETRAIN_DATA_CACHE_DIR", str(tmp_path / "cache"))
    store = s3.store()
    store.put_bytes(ObjectURI(bucket, "ds/part-0.npz"), npz_bytes(*shard_arrays(0, 10)))
    store.put_bytes(ObjectURI(bucket, "ds/part-1.npz"), damage)
    with pytest.raises(LoadError) as err:
        load_data(Dataset(uri=f"s3://{bucket}/ds/"), seed=0)
    assert f"s3://{bucket}/ds/part-1.npz" in str(err.value) and words in str(err.value)


def test_quantities_are_read_as_kubernetes_writes_them():
    assert parse_quantity("10Gi", "f") == 10 << 30
    assert parse_quantity("500M", "f") == 500_000_000
    assert parse_quantity("1.5Ki", "f") == 1536


def test_parquet_shards_train_as_npz_shards_do(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETRAIN_DATA_CACHE_DIR", str(tmp_path / "cache"))
    npz = write_shards(tmp_path / "npz", [30, 30, 30, 30])
    parquet = write_shards(tmp_path / "parquet", [30, 30, 30, 30], "parquet")
    a = load_data(Dataset(path=str(npz), eval_fraction=0.25), seed=2)
    b = load_data(Dataset(path=str(parquet), eval_fraction=0.25, label_column="label"), seed=2)
    assert (a.input_shape, a.num_classes) == (b.input_shape, b.num_classes) == ((8,), 3)
    rows = torch.arange(len(a.train_x))
    assert torch.equal(a.train_x[rows], b.train_x[rows]) and torch.equal(a.train_y[rows], b.train_y[rows])
    assert torch.equal(a.eval_x[0:30], b.eval_x[0:30])
    # featureColumns picks and orders the features.
    c = load_data(Dataset(path=str(parquet), feature_columns=["f3", "f0"]), seed=2)
    assert c.input_shape == (2,) and torch.equal(c.train_x[rows][:, 1], a.train_x[rows][:, 0])
