"""Data for your own training script, from shards in object storage or a directory, resumable with kubetrain's
checkpoints: the reader the built-in loops use (docs/object-storage.md#data-in-shards).

    import kubetrain, kubetrain.data

    loader = kubetrain.data.shards("s3://bucket/datasets/digits/", batch_size=64, seed=0)
    state, step = kubetrain.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        loader.load_state_dict(state["data"])       # the very next sample, none twice
    for step in range(step + 1, total + 1):
        x, y, _ = loader.next_batch()
        ...
        kubetrain.save({"model": model.state_dict(), "data": loader.state_dict()}, step)

Under torchrun each rank gets its own shards (RANK and WORLD_SIZE are read from the environment). The store's
credentials are the `AWS_*` variables, as for the job's own fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["shards"]


def shards(source: str, batch_size: int, *, seed: int = 0, rank: int | None = None, world_size: int | None = None,
           label_column: str = "label", feature_columns: Sequence[str] = (), cache_size: str = "10Gi") -> Any:
    """A loader of `source` (s3://BUCKET/PREFIX/ or a directory of .npz or Parquet shards) for this rank:
    `next_batch()` -> (x, y, indices), iteration over the rest of an epoch, `state_dict()` and
    `load_state_dict()` to save and restore its position with the model, `epoch`, `steps_per_epoch`."""
    from kubetrain.trainer.loader import ShardedLoader

    return ShardedLoader(source, batch_size, seed=seed, rank=rank, world_size=world_size, label_column=label_column,
                         feature_columns=feature_columns, cache_size=cache_size)
