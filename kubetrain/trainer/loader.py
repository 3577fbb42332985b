"""A script's data from shards (`kubetrain.data.shards`): the built-in loops' shards, cache and cursor, as one
loader a script iterates and saves with its model."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import ShardCursor
from .errors import LoadError
from .objstore import is_uri, parse_uri, shared_store
from .shards import (Columns, DirectoryStorage, ObjectStorage, ShardCache, ShardedRows, ShardOrder, ShardStorage,
                     build_index, cache_root, check_shapes, parse_quantity)


class ShardedLoader:
    """A script's data from shards, as the built-in loops read theirs: batches of this rank's samples, whole
    shards a rank, a bounded cache, and a position to save with the model (`state_dict`) so that a restarted
    script reads exactly the samples that come next. `kubetrain.data.shards` makes one."""

    def __init__(self, source: str, batch_size: int, *, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, label_column: str = "label",
                 feature_columns: Sequence[str] = (), cache_size: str = "10Gi"):
        if rank is None or world_size is None:  # torchrun's environment, else one process
            rank = int(os.environ.get("RANK", "0")) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if is_uri(source):
            prefix = parse_uri(source, "kubetrain.data.shards").prefix()
            shared_store().check_bucket(prefix)
            storage: ShardStorage = ObjectStorage(prefix)
        elif Path(source).is_dir():
            storage = DirectoryStorage(Path(source), "kubetrain.data.shards")
        else:
            raise LoadError(f"kubetrain.data.shards: {source}: neither s3://BUCKET/PREFIX/ nor a directory of shards")
        columns = Columns(label_column, tuple(feature_columns))
        root = cache_root()
        metas = build_index(storage, columns, root / "index")
        check_shapes(metas, storage)
        self.rows = ShardedRows(storage, metas, ShardCache(root / "shards", parse_quantity(cache_size, "cache_size")),
                                columns, lambda y, where: torch.as_tensor(np.asarray(y)))
        self.order = ShardOrder([m.rows for m in metas], seed)
        self.cursor = ShardCursor(len(self.rows), rank, world_size, batch_size, seed, order=self.order,
                                  on_epoch=self.rows.plan)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch (0-based)."""
        return self.cursor.epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.cursor.steps_per_epoch

    def __len__(self) -> int:
        """Samples in all (every rank's)."""
        return len(self.rows)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, indices) of the next batch: float32 features, the labels as stored, each sample's index."""
        indices = self.cursor.next_batch()
        x, y = self.rows.rows(indices)
        return torch.as_tensor(x, dtype=torch.float32), y, indices

    def __iter__(self) -> Any:
        """The batches left of the current epoch."""
        epoch = self.cursor.epoch
        while self.cursor.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position: save it with the model (`kubetrain.save({..., "data": loader.state_dict()}, step)`)."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` (from a checkpoint) left off."""
        self.cursor.load_state_dict(state)

    def close(self) -> None:
        self.rows.close()
