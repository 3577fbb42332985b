"""`kubetrain bench checkpoint --to s3://...` and `kubetrain bench data --from s3://...`: object storage, as ratios.

Both run against the store the AWS_* variables name (locally: `eval $(hack/objstore up)`), in one run:

checkpoint --to URI (a model of square layers with SGD and momentum, as `bench checkpoint`):
- `ratio_blocking_to_sync_upload`: how long a background `save` holds the loop (the copy into memory)
  against the same save made durable before returning: written locally, uploaded, committed (aim <= 0.1);
- `ratio_upload_to_plain_put`: the checkpoint's upload throughput (kubetrain's multipart upload, parts in
  parallel, hashed, its size read back) against one plain PUT of the same bytes by the same client (aim
  >= 0.8), each the median of `rounds`, alternated;
- with `--sharded`: a state of `gib` GiB sharded over 2 ranks (FSDP2), every rank uploading its own shards:
  blocking against synchronous, and the restore from the bucket into 2 ranks and into 1 (resharded).

data --from URI (shards of .npz under a prefix, made if `--make` asks):
- samples per second of the data loader (the cursor and the shard reader, no model) over the first epoch
  (every shard fetched from the store, `PREFETCH_SHARDS` ahead), and over a later epoch (from the local
  cache), each against the same shards read from a local directory: `ratio_first_epoch`,
  `ratio_cached` (aim >= 0.9).
"""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.trainer.objstore import ObjectStore, ObjectURI, parse_uri
from kubetrain.trainer.object_checkpoints import ObjectCheckpointStore

from .checkpoint import Loop


def _prefix(uri: str, leaf: str) -> ObjectURI:
    root = parse_uri(uri, "--to").prefix()
    return root.child(f"{leaf}-{os.getpid()}-{int(time.time())}/")


def bench_checkpoint_to(uri: str, model_mb: int, rounds: int) -> dict[str, Any]:
    if model_mb < 100 or rounds < 1:
        raise ValueError("--model-mb must be at least 100, --rounds at least 1")
    store = ObjectStore()
    store.check_bucket(parse_uri(uri, "--to"))
    loop = Loop(model_mb)
    for _ in range(3):
        loop.train_one()
    prefix = _prefix(uri, "bench-checkpoint")
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-s3-") as tmp:
        sync = ObjectCheckpointStore(Path(tmp) / "sync", prefix.child("sync/"), 2, "bench", background=False,
                                     store=store)
        background = ObjectCheckpointStore(Path(tmp) / "bg", prefix.child("bg/"), 2, "bench", background=True,
                                           store=store)
        sync_seconds, blocking, waits, uploads, puts = [], [], [], [], []
        for r in range(rounds + 1):  # the first background save allocates its buffers: not counted
            loop.train_one()
            started = time.perf_counter()
            sync.save(loop.step, loop.state())
            sync_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            background.save(loop.step, loop.state())
            blocking.append(time.perf_counter() - started)
            started = time.perf_counter()
            background.wait()
            waits.append(time.perf_counter() - started)
            # The file's upload alone, and one plain PUT of the same bytes, alternated.
            path = sync.path_of(loop.step)
            size = path.stat().st_size
            started = time.perf_counter()
            store.upload(path, prefix.child(f"upload-{r}.pt"))
            uploads.append(size / (time.perf_counter() - started))
            data = path.read_bytes()
            started = time.perf_counter()
            store.request("PUT", prefix.child(f"put-{r}.pt"), body=data)
            puts.append(size / (time.perf_counter() - started))
            del data
        store.delete([i.uri for i in store.list(prefix)])
    steady = blocking[1:]
    return {
        "benchmark": "checkpoint --to",
        "store": store.endpoint,
        "model": f"{len(loop.model)} x Linear(2048, 2048), SGD momentum 0.9",  # type: ignore[arg-type]  # an nn.Sequential
        "file_bytes": size,
        "rounds": rounds,
        "sync_upload_seconds": round(statistics.median(sync_seconds), 4),
        "blocking_seconds": round(statistics.median(steady), 4),
        "blocking_seconds_first": round(blocking[0], 4),
        "background_finish_seconds": round(statistics.median(waits[1:]), 4),
        "ratio_blocking_to_sync_upload": round(statistics.median(steady) / statistics.median(sync_seconds), 4),
        "upload_bytes_per_second": round(statistics.median(uploads)),
        "plain_put_bytes_per_second": round(statistics.median(puts)),
        "ratio_upload_to_plain_put": round(statistics.median(uploads) / statistics.median(puts), 4),
        "retries": store.stats.retries,
        "aims": "ratio_blocking_to_sync_upload <= 0.1; ratio_upload_to_plain_put >= 0.8",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def bench_sharded_to(uri: str, gib: float) -> dict[str, Any]:
    """kubetrain/bench/sharded.py's group with its checkpoints in the bucket (every rank uploading its shards)."""
    from . import sharded

    prefix = _prefix(uri, "bench-sharded")
    ObjectStore().check_bucket(prefix)
    try:
        return {**sharded.bench_sharded(gib, store_uri=str(prefix)), "benchmark": "checkpoint --sharded --to",
                "store": ObjectStore().endpoint}
    finally:
        store = ObjectStore()
        store.delete([i.uri for i in store.list(prefix)])


def make_shards(uri: str, shards: int, rows: int, features: int) -> ObjectURI:
    """`shards` .npz shards of `rows` random rows each under the prefix (a benchmark's dataset)."""
    prefix = parse_uri(uri, "--from").prefix()
    store = ObjectStore()
    rng = np.random.default_rng(0)
    for i in range(shards):
        buf = io.BytesIO()
        np.savez(buf, x=rng.normal(size=(rows, features)).astype(np.float32),
                 y=rng.integers(0, 10, rows).astype(np.int64))
        store.put_bytes(prefix.child(f"part-{i:04d}.npz"), buf.getvalue())
    return prefix


def _epoch_rate(rows: Any, order: Any, batch: int, epoch: int, world: int = 1) -> float:
    from kubetrain.trainer.data import ShardCursor

    cursor = ShardCursor(len(rows), 0, world, batch, 0, order=order, on_epoch=rows.plan)
    cursor.load_state_dict({**cursor.state_dict(), "epoch": epoch})
    steps = cursor.steps_left(epoch + 1)
    started = time.perf_counter()
    samples = 0
    for _ in range(steps):
        x, _ = rows.rows(cursor.next_batch())
        samples += len(x)
    return samples / (time.perf_counter() - started)


def bench_data(uri: str, batch: int, cache: str, make: int, rows_per_shard: int, features: int) -> dict[str, Any]:
    from kubetrain.trainer.shards import (Columns, DirectoryStorage, ObjectStorage, ShardCache, ShardedRows,
                                          ShardOrder, build_index, parse_quantity)

    if make:
        make_shards(uri, make, rows_per_shard, features)
    prefix = parse_uri(uri, "--from").prefix()
    store = ObjectStore()
    store.check_bucket(prefix)
    targets = (lambda y, where: torch.as_tensor(np.asarray(y)))
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-data-") as tmp:
        remote = ObjectStorage(prefix, store)
        metas = build_index(remote, Columns(), None)
        local_dir = Path(tmp) / "local"
        local_dir.mkdir()
        for meta in metas:  # the same shards on local disk: the baseline
            store.download(prefix.child(meta.name), local_dir / meta.name, size=meta.size)
        local = DirectoryStorage(local_dir, "local")
        order = ShardOrder([m.rows for m in metas], seed=0)
        cache_bytes = parse_quantity(cache, "--cache")
        rates: dict[str, float] = {}
        local_rows = ShardedRows(local, build_index(local, Columns(), None), ShardCache(Path(tmp) / "unused", 1),
                                 Columns(), targets)
        remote_rows = ShardedRows(remote, metas, ShardCache(Path(tmp) / "cache", cache_bytes), Columns(), targets)
        rates["local_epoch_0"] = _epoch_rate(local_rows, order, batch, 0)
        before = store.stats.downloaded_bytes
        rates["s3_first_epoch"] = _epoch_rate(remote_rows, order, batch, 0)
        fetched = store.stats.downloaded_bytes - before
        rates["local_epoch_1"] = _epoch_rate(local_rows, order, batch, 1)
        rates["s3_cached_epoch"] = _epoch_rate(remote_rows, order, batch, 1)
        remote_rows.close()
    total = sum(m.size for m in metas)
    return {
        "benchmark": "data",
        "store": store.endpoint,
        "shards": len(metas),
        "rows": sum(m.rows for m in metas),
        "dataset_bytes": total,
        "cache_bytes": cache_bytes,
        "batch": batch,
        "first_epoch_fetched_bytes": fetched,
        "samples_per_second": {k: round(v) for k, v in rates.items()},
        "ratio_first_epoch": round(rates["s3_first_epoch"] / rates["local_epoch_0"], 4),
        "ratio_cached": round(rates["s3_cached_epoch"] / rates["local_epoch_1"], 4),
        "aims": "ratio_cached >= 0.9",
        "note": "the data loader alone (cursor, shard reader, decode), no model: the most a store's latency can show",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }

