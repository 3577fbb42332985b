"""Training data: loading the datasets into tensors, and each rank's deterministic order over them."""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.api.spec import Dataset

from .errors import ConfigError, LoadError
from .objectives import CROSS_ENTROPY, Objective, build_objective
from .objstore import parse_uri, shared_store
from .plugins import call_with_args, load_entrypoint
from .shards import (BadShard, Columns, DirectoryStorage, LazyRows, ObjectStorage, ShardCache, ShardedRows,
                     ShardOrder, ShardStorage, decode_shard, build_index, cache_root, check_shapes, eval_shards,
                     parse_quantity, read_npz)


@dataclass
class Data:
    """A dataset split into train and eval tensors (float32 inputs; targets as `objective` takes them), on the CPU."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    input_shape: tuple[int, ...]
    """Shape of one sample, without the batch dimension."""
    num_classes: int | None
    """Classification (crossEntropy): max label + 1, the width of the model's output. None otherwise."""
    target_shape: tuple[int, ...] | None = None
    """Regression (every other loss): shape of one sample's target, and so of the model's output for it;
    a 1-D y is taken as one value per sample, (1,). None for classification."""
    objective: Objective = CROSS_ENTROPY
    """The loss the targets were prepared for (spec.training.loss)."""
    order: Any = None
    """How an epoch orders the training samples: None, a seeded shuffle of them all; a ShardOrder for sharded
    data (shards.py: each rank gets whole shards)."""

    def cursor(self, rank: int, world_size: int, batch_size: int, seed: int) -> "ShardCursor":
        """The cursor of rank `rank` of `world_size` over the training samples, ordered as this data wants."""
        return ShardCursor(len(self.train_x), rank, world_size, batch_size, seed, order=self.order,
                           on_epoch=getattr(self.train_x, "plan", None))

    def quorum_cursor(self, batch_size: int, seed: int, nominal: int) -> "QuorumCursor":
        """The one cursor of a fault-tolerant job's replica groups (dealt by each step's quorum)."""
        return QuorumCursor(len(self.train_x), batch_size, seed, nominal, order=self.order,
                            on_epoch=getattr(self.train_x, "plan", None))

    def attach_metrics(self, metrics: Any) -> None:
        """Count sharded data's shard reads (cache or store) and object-storage traffic in `metrics`."""
        from .metrics import attach_metrics

        attach_metrics(shared_store(), metrics)
        for rows in (self.train_x, self.eval_x):
            source = getattr(rows, "source", None)
            if source is not None:
                source.on_read = lambda where: metrics.data_shard_reads_total.labels(source=where).inc()


# --- built-in datasets --------------------------------------------------------


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 samples, flat 64 features scaled to [0, 1])."""
    # Importing sklearn costs ~2 s, paid by every replica at every start; the
    # data is one small CSV inside the package (pixels, then the label), so
    # read it directly and fall back to the public loader if it ever moves.
    location = importlib.util.find_spec("sklearn")
    roots = location.submodule_search_locations if location else None
    csv = Path(roots[0]) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if csv is not None and csv.is_file():
        table = np.loadtxt(csv, delimiter=",")
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.data, bunch.target
    return pixels.astype(np.float32) / 16.0, labels.astype(np.int64)


def synthetic(
    samples: int = 2048, features: int = 32, classes: int = 4, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters, one per class, with unit noise: learnable, and the same for every seed."""
    if samples < 1 or features < 1 or classes < 2:
        raise ConfigError(
            "spec.dataset.args: synthetic needs samples >= 1, features >= 1 and classes >= 2, "
            f"got samples={samples}, features={features}, classes={classes}"
        )
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.0, (classes, features))
    y = rng.integers(0, classes, samples)
    x = centers[y] + rng.normal(0.0, 1.0, (samples, features))
    return x.astype(np.float32), y.astype(np.int64)


BUILTIN_DATASETS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "digits": digits,
    "synthetic": synthetic,
}


def _npz(path: str | Path, where: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    where = where or f"spec.dataset.path: {path}"
    if not Path(path).is_file():
        raise LoadError(f"{where}: no such file")
    # A shard's bounded reader (nothing unpickled, nothing inflated past what the arrays' headers declare).
    try:
        return read_npz(Path(path))
    except BadShard as err:
        hint = "; expected x (features) and y (labels)" if "has no array" in str(err) else ""
        raise LoadError(f"{where}: {err}{hint}") from None


def _object_npz(uri_text: str) -> tuple[np.ndarray, np.ndarray]:
    """One .npz object of object storage, fetched into the data cache once (kept while its size is the same)."""
    uri = parse_uri(uri_text, "spec.dataset.uri")
    store = shared_store()
    store.check_bucket(uri)
    info = store.head(uri)
    if info is None:
        raise LoadError(f"spec.dataset.uri: {uri}: no such object at {store.endpoint}")
    local = cache_root() / "objects" / (hashlib.sha256(str(uri).encode()).hexdigest()[:32] + ".npz")
    if not (local.is_file() and local.stat().st_size == info.size):
        local.parent.mkdir(parents=True, exist_ok=True)
        store.download(uri, local, size=info.size)
    return _npz(local, f"spec.dataset.uri: {uri}")


def _shard_storage(spec: Dataset) -> ShardStorage | None:
    """Where the spec's shards lie: a uri prefix (any uri but one ending in .npz) or a path directory; None for
    one file or object, or data that is not a file at all."""
    if spec.uri is not None and not spec.uri.endswith(".npz"):
        prefix = parse_uri(spec.uri, "spec.dataset.uri").prefix()
        shared_store().check_bucket(prefix)
        return ObjectStorage(prefix)
    if spec.path is not None and Path(spec.path).is_dir():
        return DirectoryStorage(Path(spec.path), "spec.dataset.path")
    return None


def _raw(spec: Dataset, seed: int) -> tuple[Any, Any, str]:
    """The (x, y) arrays the spec points at, and the field path to blame for their content."""
    if spec.path is not None:
        x, y = _npz(spec.path)
        return x, y, f"spec.dataset.path: {spec.path}"
    if spec.uri is not None:
        x, y = _object_npz(spec.uri)
        return x, y, f"spec.dataset.uri: {spec.uri}"
    if spec.entrypoint is not None:
        fn = load_entrypoint(spec.entrypoint, "spec.dataset.entrypoint")
        result = call_with_args(fn, spec.args, spec.entrypoint, "spec.dataset.entrypoint")
        if not (isinstance(result, tuple) and len(result) == 2):
            raise LoadError(
                f"spec.dataset.entrypoint: {spec.entrypoint} returned {type(result).__name__}; expected (x, y)"
            )
        return result[0], result[1], f"spec.dataset.entrypoint: {spec.entrypoint}"
    if spec.name not in BUILTIN_DATASETS:
        raise LoadError(
            f"spec.dataset.name: unknown dataset {spec.name!r}; expected one of {', '.join(BUILTIN_DATASETS)}"
        )
    args = dict(spec.args)
    if spec.name == "synthetic":
        args.setdefault("seed", seed)
    x, y = call_with_args(BUILTIN_DATASETS[spec.name], args, spec.name, "spec.dataset.args")
    return x, y, f"spec.dataset.name: {spec.name}"


def _tensors(x: Any, y: Any, where: str, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        x = torch.as_tensor(np.asarray(x, dtype=np.float32))
        y_arr = np.asarray(y)
    except (TypeError, ValueError) as err:
        raise LoadError(f"{where}: x must be numeric: {err}") from None
    if x.ndim < 2 or len(x) == 0:
        raise LoadError(f"{where}: x must hold samples along its first axis, got shape {tuple(x.shape)}")
    if y_arr.ndim < 1 or len(y_arr) != len(x):
        raise LoadError(
            f"{where}: y must hold one target per sample of x ({len(x)}) along its first axis, got shape {y_arr.shape}"
        )
    return x, objective.targets(y_arr, where)


def load_data(spec: Dataset, seed: int, loss: str = "crossEntropy") -> Data:
    """Load the dataset of `spec` for the objective `loss` (spec.training.loss) and split it, seeded.

    The loss decides what y must be: integer class labels for crossEntropy,
    float targets of any shape otherwise (see objectives.py).
    """
    objective = build_objective(loss)
    storage = _shard_storage(spec)
    if storage is not None:
        sharded = _load_shards(spec, seed, objective, storage)
        if isinstance(sharded, Data):
            return sharded
        x_raw, y_raw, where = sharded  # one shard: read whole and split by rows, as one file is
    else:
        x_raw, y_raw, where = _raw(spec, seed)
    x, y = _tensors(x_raw, y_raw, where, objective)
    n = len(x)
    n_eval = int(round(n * spec.eval_fraction))
    if n - n_eval < 1:
        raise LoadError(f"{where}: {n} samples leave none for training with evalFraction {spec.eval_fraction}")
    # The split depends on the seed alone, so every replica of a job holds out the same samples.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    train, held_out = order[n_eval:], order[:n_eval]
    return Data(
        train_x=x[train],
        train_y=y[train],
        eval_x=x[held_out],
        eval_y=y[held_out],
        input_shape=tuple(x.shape[1:]),
        num_classes=int(y.max()) + 1 if objective.classification else None,
        target_shape=None if objective.classification else tuple(y.shape[1:]),
        objective=objective,
    )


def _load_shards(spec: Dataset, seed: int, objective: Objective,
                 storage: ShardStorage) -> "Data | tuple[np.ndarray, np.ndarray, str]":
    """Sharded data: indexed now, read as the ranks reach its shards (shards.py). A single shard comes back
    whole, as (x, y, where), to be split by rows as one file is."""
    columns = Columns(spec.label_column, tuple(spec.feature_columns))
    root = cache_root()
    metas = build_index(storage, columns, root / "index")
    check_shapes(metas, storage)
    cache = ShardCache(root / "shards", parse_quantity(spec.cache_size, "spec.dataset.cacheSize"))
    if len(metas) == 1:
        path, _ = cache.get(storage, metas[0])
        try:
            x, y = decode_shard(path, columns, storage.describe(metas[0].name))
        except BadShard as err:
            raise LoadError(f"{storage.describe(metas[0].name)}: a corrupt or unusable shard: {err}") from None
        return x, y, storage.describe(metas[0].name)
    first = metas[0]
    if objective.classification and not np.issubdtype(np.dtype(first.y_dtype), np.integer):
        objective.targets(np.zeros(1, dtype=first.y_dtype), storage.describe(first.name))  # its own message
    held = eval_shards(len(metas), spec.eval_fraction, seed)
    train = ShardedRows(storage, [m for i, m in enumerate(metas) if i not in held], cache, columns, objective.targets)
    evals = ShardedRows(storage, [m for i, m in enumerate(metas) if i in held], cache, columns, objective.targets)
    return Data(
        train_x=LazyRows(train, 0), train_y=LazyRows(train, 1),  # type: ignore[arg-type]
        eval_x=LazyRows(evals, 0), eval_y=LazyRows(evals, 1),  # type: ignore[arg-type]
        input_shape=tuple(first.x_shape),
        num_classes=int(max(m.y_max for m in metas)) + 1 if objective.classification else None,
        target_shape=None if objective.classification else (tuple(first.y_shape) or (1,)),
        objective=objective,
        order=ShardOrder([m.rows for m in train.metas], seed),
    )


# --- order ----------------------------------------------------------------------


@dataclass(frozen=True)
class EpochPlan:
    """The positions of an epoch's shuffled order that its ranks share, and how.

    The order's positions `holes`, then `start`, `start + 1`, ... `end - 1`, are
    dealt round-robin: rank r of W takes the r-th, (r+W)-th, ... of them. With
    `equal` the count is cut to a multiple of W first, so every rank gets as
    many (a DDP group runs the same steps on every rank). An epoch nobody
    re-dealt has the default plan: no holes, every position, equal, which
    gives rank r the positions r, r+W, r+2W, ... of the first N // W * W.
    A re-deal (`redeal`) writes the plan of what was left of an epoch: the
    holes are positions some ranks had not reached while others had gone past
    them (workers that do not step together); the rest is one run.
    """

    holes: tuple[int, ...] = ()
    start: int = 0
    end: int = 0
    equal: bool = True
    lanes: int = 0
    """The lanes the epoch's order was made for (sharded data: a ShardOrder deals shards to one lane per
    rank), kept when the epoch is dealt again to another number of ranks; 0: the dealing world size."""

    @property
    def size(self) -> int:
        return len(self.holes) + max(0, self.end - self.start)

    def dealt(self, world: int) -> int:
        """How many positions are dealt among `world` ranks."""
        return self.size // world * world if self.equal else self.size

    def count(self, rank: int, world: int) -> int:
        """How many positions rank `rank` gets."""
        return len(range(rank, self.dealt(world), world))

    def _run(self, rank: int, world: int) -> range:
        """Rank `rank`'s part of the run start..end-1 (what comes after its holes)."""
        total, h = self.dealt(world), len(self.holes)
        if total <= h:
            return range(0)
        first = rank if rank >= h else h + (rank - h) % world  # its first index past the holes
        return range(self.start + first - h, self.start + total - h, world)

    def _holes(self, rank: int, world: int) -> list[int]:
        """Rank `rank`'s part of the holes (what it takes first)."""
        return [self.holes[j] for j in range(rank, min(len(self.holes), self.dealt(world)), world)]

    def share(self, rank: int, world: int) -> list[int]:
        """Rank `rank`'s positions, in the order it takes them."""
        return self._holes(rank, world) + list(self._run(rank, world))

    def take(self, order: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s samples of an epoch whose shuffled order is `order` (`share`, as a slice where it can)."""
        holes = self._holes(rank, world)
        run = self._run(rank, world)
        tail = order[run.start : run.stop : run.step] if len(run) else order[:0]
        return torch.cat([order[torch.tensor(holes, dtype=torch.long)], tail]) if holes else tail

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"holes": list(self.holes), "start": self.start, "end": self.end, "equal": self.equal}
        if self.lanes:
            doc["lanes"] = self.lanes
        return doc

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "EpochPlan":
        return cls(tuple(int(h) for h in data["holes"]), int(data["start"]), int(data["end"]), bool(data["equal"]),
                   int(data.get("lanes", 0)))

    @classmethod
    def of(cls, positions: list[int], equal: bool, lanes: int = 0) -> "EpochPlan":
        """The plan dealing `positions` (sorted, distinct): the longest run at their end kept as a range."""
        if not positions:
            return cls((), 0, 0, equal, lanes)
        k = len(positions) - 1
        while k > 0 and positions[k - 1] == positions[k] - 1:
            k -= 1
        return cls(tuple(positions[:k]), positions[k], positions[-1] + 1, equal, lanes)


class ShardCursor:
    """This rank's way through the training samples: shuffled per epoch, disjoint across ranks.

    Every epoch shuffles all sample indices with `seed + epoch` (the same
    permutation on every rank) and deals positions of that order to the ranks
    by the epoch's `EpochPlan`: by default rank r takes the samples at
    positions r, r+W, r+2W, ... of the first `num_samples // W * W`, so shards
    are disjoint, equally long (ranks run the same steps per epoch), and
    together cover the data but for fewer than W samples, a different few each
    epoch. The last batch of a shard may be short. The state is the epoch, the
    position in this rank's shard and the plans of re-dealt epochs, so a
    resumed cursor continues with the very next sample; when the number of
    ranks changes (an elastic job), `redeal` gives the new ranks what is left
    of the epoch in progress, no sample twice.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, batch_size: int, seed: int,
                 order: Any = None, on_epoch: Callable[[torch.Tensor], None] | None = None):
        """`order`: what orders an epoch (`order.order(epoch, lanes)`, a permutation of the samples; None: a
        seeded shuffle of all of them); `on_epoch(indices)`: told this rank's share of each epoch as it
        begins (sharded data fetches its shards ahead)."""
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}")
        if num_samples < world_size:
            raise ConfigError(
                f"{num_samples} training samples cannot be sharded over {world_size} ranks; "
                "use more data or fewer workers"
            )
        if batch_size < 1:
            raise ConfigError(f"spec.training.batchSize: must be at least 1, got {batch_size}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.order = order
        self.on_epoch = on_epoch
        if order is not None and order.num_samples != num_samples:
            raise ConfigError(f"the sample order covers {order.num_samples} samples, the data holds {num_samples}")
        self.plans: dict[int, EpochPlan] = {}  # epochs dealt again by a resize; the others: the default plan
        self._epoch = 0
        self._position = 0
        self._shard: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of this epoch's shard already handed out; 0 right after an epoch ends."""
        return self._position

    def plan(self, epoch: int) -> EpochPlan:
        return self.plans.get(epoch) or EpochPlan((), 0, self.num_samples, True)

    def positions(self, epoch: int) -> list[int]:
        """This rank's positions in `epoch`'s order."""
        return self.plan(epoch).share(self.rank, self.world_size)

    @property
    def shard_size(self) -> int:
        """Samples of this rank's shard in the current epoch."""
        return self.plan(self._epoch).count(self.rank, self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a whole epoch at this world size (the default plan)."""
        return math.ceil(self.num_samples // self.world_size / self.batch_size)

    @property
    def epochs_done(self) -> float:
        """Epochs this cursor went through: whole ones, and the part of the current one."""
        size = self.shard_size
        return self._epoch + (self._position / size if size else 0.0)

    def steps_left(self, epochs: int) -> int:
        """Batches this cursor hands out before it reaches epoch `epochs`."""
        left = 0
        for epoch in range(self._epoch, epochs):
            size = self.plan(epoch).count(self.rank, self.world_size)
            start = self._position if epoch == self._epoch else 0
            left += math.ceil((size - start) / self.batch_size)
        return left

    def _current_shard(self) -> torch.Tensor:
        if self._shard is None:
            plan = self.plan(self._epoch)
            if self.order is not None:
                order = self.order.order(self._epoch, plan.lanes or self.world_size)
            else:
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                order = torch.randperm(self.num_samples, generator=generator)
            self._shard = plan.take(order, self.rank, self.world_size)
            if self.on_epoch is not None:
                self.on_epoch(self._shard[self._position:])
        return self._shard

    def _next_epoch(self) -> None:
        self.plans.pop(self._epoch, None)
        self._epoch += 1
        self._position = 0
        self._shard = None

    def next_batch(self) -> torch.Tensor:
        """Indices of the next batch; after the last batch of a shard the epoch advances."""
        while self.shard_size == 0:  # a re-dealt epoch with nothing left for this rank
            self._next_epoch()
        end = min(self._position + self.batch_size, self.shard_size)
        batch = self._current_shard()[self._position : end].clone()
        self._position = end
        if end == self.shard_size:
            self._next_epoch()
        return batch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self._epoch,
            "position": self._position,
            "num_samples": self.num_samples,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
        }
        plans = {str(e): p.to_json() for e, p in sorted(self.plans.items()) if e >= self._epoch}
        if plans:  # only once a resize re-dealt an epoch: the state stays two numbers otherwise
            state["plans"] = plans
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where `state` left off; it must describe the same data, shard and seed
        (a state of another world size is dealt again first: `redeal`)."""
        for key in ("num_samples", "rank", "world_size", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"cursor state was saved with {key}={state[key]}, this cursor has {key}={getattr(self, key)}"
                )
        plans = {int(e): EpochPlan.from_json(p) for e, p in (state.get("plans") or {}).items()}
        self.plans, self._epoch = plans, int(state["epoch"])
        if not (0 <= state["position"] < self.shard_size or state["position"] == 0):
            raise ConfigError(f"cursor position {state['position']} is outside the shard of {self.shard_size}")
        self._position = int(state["position"])
        self._shard = None


@dataclass(frozen=True)
class Block:
    """The samples one step of a fault-tolerant job trains: positions start .. start + size - 1 of the epoch's
    order, dealt round-robin to `lanes` ranks (lane i takes start + i, start + i + lanes, ...)."""

    epoch: int
    start: int
    size: int
    lanes: int

    def count(self, lane: int) -> int:
        """How many samples lane `lane` trains (0 for a lane past the block: a short last block)."""
        return len(range(lane, self.size, self.lanes)) if 0 <= lane < self.lanes else 0


class QuorumCursor:
    """The job's one way through the training samples when the ranks that train change from step to step
    (fault-tolerant DDP: the groups in each step's quorum). Every replica group holds the same cursor; it is
    part of the committed state (a heal carries it, a checkpoint holds it).

    An epoch's order is ShardCursor's (a seeded shuffle of every sample, or the data's own order for
    `lanes` lanes). Each step the ranks taking part share the next `Block` of it, `batch_size` samples each;
    a committed step moves the cursor past its block (`advance`), a discarded one does not, so its samples
    are trained again by the next quorum, however many ranks it has. Every sample of an epoch is trained
    exactly once whatever the faults: the epoch takes more steps while fewer ranks train.

    An epoch holds its first `cut` positions: the samples cut to a multiple of the ranks training when it
    begins, as plain DDP leaves out fewer than its world size (a different few each epoch). With the same
    ranks every step, the blocks are exactly plain DDP's global batches, and lane r's share of step s is the
    batch DDP gives rank r at step s. Pure: no process group, no clock.

    `nominal`: the ranks the job trains with when none is missing (ddp.nodes x procsPerNode when it began,
    kept in the state so that a group started by a resize agrees): it measures the job in plain DDP's steps,
    of `nominal` x batchSize samples (`nominal_step`, where a run of maxSteps ends: `end`).
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, nominal: int, order: Any = None,
                 on_epoch: Callable[[torch.Tensor], None] | None = None):
        if not 1 <= nominal <= num_samples:
            raise ConfigError(f"{num_samples} training samples cannot be sharded over {nominal} ranks; "
                              "use more data or fewer workers")
        self.nominal = nominal
        if batch_size < 1:
            raise ConfigError(f"spec.training.batchSize: must be at least 1, got {batch_size}")
        if num_samples < 1:
            raise ConfigError("no training samples to deal")
        if order is not None and order.num_samples != num_samples:
            raise ConfigError(f"the sample order covers {order.num_samples} samples, the data holds {num_samples}")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.order, self.on_epoch = order, on_epoch
        self.epoch = 0
        self.position = 0
        self.cut = 0
        """Positions of the current epoch (0 until it begins: `begin`)."""
        self.lanes = 0
        """The lanes the current epoch's order was made for (sharded data deals shards by lane)."""
        self.trained = 0
        """Samples the committed steps trained, every epoch."""
        self._order: torch.Tensor | None = None

    def begin(self, lanes: int) -> None:
        """Begin the current epoch, if it has not begun, for `lanes` training ranks: its cut and order."""
        if self.cut:
            return
        if not 1 <= lanes <= self.num_samples:
            raise ConfigError(f"{self.num_samples} training samples cannot be dealt to {lanes} ranks; "
                              "use more data or fewer workers")
        self.cut, self.lanes = self.num_samples // lanes * lanes, lanes
        self._order = None

    def epoch_order(self) -> torch.Tensor:
        """The current epoch's order of every sample (its first `cut` positions are trained)."""
        if self._order is None:
            if self.order is not None:
                self._order = self.order.order(self.epoch, self.lanes)
            else:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=generator)
        return self._order

    def block(self, lanes: int, end: int | None = None) -> Block:
        """The next step's block for `lanes` training ranks, ending at the epoch's cut (or at `end` before it:
        a job that stops mid-epoch)."""
        if lanes < 1:
            raise ConfigError(f"a step needs at least one training rank, got {lanes}")
        self.begin(lanes)
        stop = self.cut if end is None else min(end, self.cut)
        return Block(self.epoch, self.position, max(0, min(lanes * self.batch_size, stop - self.position)), lanes)

    def share(self, block: Block, lane: int) -> torch.LongTensor:
        """Lane `lane`'s samples of `block` (none for a lane past it)."""
        if block.epoch != self.epoch or block.start != self.position:
            raise ValueError(f"block {block} is not the cursor's next (epoch {self.epoch}, position {self.position})")
        if not 0 <= lane < block.lanes:
            return torch.empty(0, dtype=torch.long)  # type: ignore[return-value]
        return self.epoch_order()[block.start + lane: block.start + block.size: block.lanes].clone()  # type: ignore[return-value]

    def advance(self, block: Block) -> bool:
        """Move past a committed step's block; True when it ended the epoch."""
        if block.epoch != self.epoch or block.start != self.position:
            raise ValueError(f"block {block} is not the cursor's next (epoch {self.epoch}, position {self.position})")
        self.position += block.size
        self.trained += block.size
        if self.position < self.cut:
            return False
        self.epoch, self.position, self.cut, self.lanes, self._order = self.epoch + 1, 0, 0, 0, None
        return True

    @property
    def steps_per_epoch(self) -> int:
        """Plain DDP's steps of an epoch at the nominal ranks (ShardCursor.steps_per_epoch)."""
        return math.ceil(self.num_samples // self.nominal / self.batch_size)

    @property
    def nominal_step(self) -> int:
        """Plain DDP's step that the cursor is at: the learning rate's schedule follows it."""
        return self.epoch * self.steps_per_epoch + self.position // (self.nominal * self.batch_size)

    @property
    def epochs_done(self) -> float:
        return self.epoch + (self.position / self.cut if self.cut else 0.0)

    def end(self, max_steps: int | None, epochs: int | None) -> tuple[int, int]:
        """(epoch, position) where training ends: after `epochs` epochs, or after the samples of `max_steps`
        of plain DDP's steps at the nominal ranks."""
        if max_steps is None:
            return (epochs or 0, 0)
        epoch, steps = divmod(max_steps, self.steps_per_epoch)
        return (epoch, steps * self.nominal * self.batch_size)

    def done(self, end: tuple[int, int]) -> bool:
        return (self.epoch, self.position) >= end

    def next_block(self, lanes: int, end: tuple[int, int]) -> Block:
        """`block` up to `end`."""
        return self.block(lanes, end[1] if self.epoch == end[0] else None)

    def steps_left(self, end: tuple[int, int], lanes: int) -> int:
        """Steps before `end` if `lanes` ranks train every one (epochs not begun yet cut at the nominal ranks)."""
        if self.done(end):
            return 0
        batch = lanes * self.batch_size
        cut = self.num_samples // self.nominal * self.nominal
        here = (self.cut or cut) if self.epoch < end[0] else min(self.cut or cut, end[1])
        left = math.ceil((here - self.position) / batch)
        if end[0] > self.epoch:
            left += (end[0] - self.epoch - 1) * math.ceil(cut / batch) + math.ceil(end[1] / batch)
        return left

    def hint(self, lane: int, lanes: int) -> None:
        """Tell `on_epoch` (sharded data fetches ahead) what lane `lane` of `lanes` trains of the epoch if its
        ranks stay: its share of what is left."""
        if self.on_epoch is not None and self.cut:
            self.on_epoch(self.epoch_order()[self.position + lane: self.cut: lanes])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "cut": self.cut, "lanes": self.lanes,
                "nominal": self.nominal, "trained": self.trained, "num_samples": self.num_samples, "seed": self.seed,
                "dealt": "quorum"}

    def seek(self, step: int) -> None:
        """Where a fault-free run at the nominal ranks is after `step` committed steps: the migration of a
        checkpoint written before the cursor was part of the state (kubetrain of 2026-12-04, whose groups each
        trained a shard of their own, the place a function of the step). The resumed run goes on at the same
        epoch and the same point of it; which samples the rest of that epoch trains follows today's order, so a
        few of them may be trained twice or not at all in that one epoch (every later epoch: each once)."""
        epoch, done = divmod(max(step, 0), self.steps_per_epoch)
        cut = self.num_samples // self.nominal * self.nominal
        position = min(done * self.nominal * self.batch_size, cut)
        if position >= cut:
            epoch, position = epoch + 1, 0
        self.trained = epoch * cut + position
        # An epoch not begun yet has no cut (`begin` makes it for the ranks that start it).
        self.epoch, self.position, self._order = epoch, position, None
        self.cut, self.lanes = (cut, self.nominal) if position else (0, 0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where `state` (a group's, the same data and seed) left off."""
        if state.get("dealt") != "quorum":
            raise ConfigError("the cursor state was saved by a job that dealt its data per rank (not fault-tolerant "
                              "DDP); start the fault-tolerant job afresh, or resume it without faultTolerance")
        for key in ("num_samples", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"cursor state was saved with {key}={state[key]}, this cursor has "
                                  f"{key}={getattr(self, key)}")
        epoch, position, cut, lanes = (int(state[k]) for k in ("epoch", "position", "cut", "lanes"))
        if not (0 <= cut <= self.num_samples and 0 <= position <= max(cut - 1, 0)):
            raise ConfigError(f"cursor position {position} is outside the epoch of {cut} samples")
        self.epoch, self.position, self.cut, self.lanes, self._order = epoch, position, cut, lanes, None
        self.nominal, self.trained = int(state["nominal"]), int(state["trained"])


def resume_group_cursor(cursor: ShardCursor, state: Mapping[str, Any]) -> bool:
    """Load a DDP group's cursor state into `cursor` (this rank's): every rank of a group is at the same
    epoch and position, so one saved state (rank 0's) stands for all. Saved by a group of another size
    (an elastic job resized), what the old ranks left of the epoch is dealt again among the new ones,
    in equal shares. True when it was."""
    old_world = int(state["world_size"])
    if old_world == cursor.world_size:
        cursor.load_state_dict({**state, "rank": cursor.rank})
        return False
    states = [{**state, "rank": rank} for rank in range(old_world)]
    cursor.load_state_dict(redeal(states, cursor.world_size, equal=True)[cursor.rank])
    return True


def redeal(states: Sequence[Mapping[str, Any]], world_size: int, equal: bool) -> list[dict[str, Any]]:
    """The cursor states of `world_size` new ranks that share what the old ranks (`states`, one per
    rank of the old world) had left: of the epoch in progress, and of any epoch a rank ahead had
    begun. No position one old rank took is dealt again, and none it had not taken is lost (with
    `equal`, fewer than `world_size` of them are left out, so that every new rank gets as many:
    a DDP group). Pure: the states are the cursors' `state_dict()`s."""
    if not states:
        raise ConfigError("no cursor to deal again")
    first = states[0]
    old_world = int(first["world_size"])
    for key in ("num_samples", "seed", "world_size"):
        if any(s[key] != first[key] for s in states):
            raise ConfigError(f"cursor states to deal again disagree on {key}")
    if sorted(int(s["rank"]) for s in states) != list(range(old_world)):
        raise ConfigError(f"cursor states to deal again must be one per rank of {old_world}, "
                          f"got ranks {sorted(int(s['rank']) for s in states)}")
    num_samples, seed = int(first["num_samples"]), int(first["seed"])
    if num_samples < world_size:
        raise ConfigError(f"{num_samples} training samples cannot be sharded over {world_size} ranks; "
                          "use more data or fewer workers")
    cursors = []
    for s in states:
        c = ShardCursor(num_samples, int(s["rank"]), old_world, 1, seed)
        c.load_state_dict(s)
        cursors.append(c)
    low, high = min(c.epoch for c in cursors), max(c.epoch for c in cursors)
    plans: dict[int, EpochPlan] = {}
    for epoch in range(low, high + 1):
        left: list[int] = []
        for c in cursors:
            if c.epoch == epoch:
                left += c.positions(epoch)[c.position :]
            elif c.epoch < epoch:
                left += c.positions(epoch)
        # The epoch keeps the order it was begun with: the lanes of the old world (or of an earlier re-deal).
        plans[epoch] = EpochPlan.of(sorted(left), equal, cursors[0].plan(epoch).lanes or old_world)
    out = []
    for rank in range(world_size):
        c = ShardCursor(num_samples, rank, world_size, 1, seed)
        c.plans, c._epoch = dict(plans), low
        out.append(c.state_dict())
    return out
