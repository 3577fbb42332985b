"""Datasets in shards: many .npz or Parquet files under a prefix in object storage, or in a directory, streamed.

`spec.dataset.uri: s3://BUCKET/PREFIX/` (or `path:` a directory) names shards: `.npz` files holding arrays
`x` and `y` (as one `path` file does), or Parquet files with feature and label columns. Nothing is read
whole at the start: each process indexes the shards (their rows, the features' shape and the labels,
from each file's headers and label column: a few small ranged reads per shard, kept in the cache for
the next start), then reads shards as its samples need them.

Which samples a rank trains on is decided by `ShardOrder`: each epoch shuffles the shards, deals whole
shards to `lanes` (one per rank), shuffles the rows within each shard, and interleaves the lanes so
that the cursor's round-robin deal (data.ShardCursor: rank r takes positions r, r+W, ...) gives rank r
the rows of its own lane's shards. So a rank reads only the shards it trains on, one after another
(the few rows that even out unequal lanes come last and are read from another lane's shards). Shards
are fetched a few ahead (PREFETCH_SHARDS) into a local disk cache of at most `cacheSize`, least
recently used first out, shared by the processes of one node or run; a few decoded shards stay in
memory (MEMORY_SHARDS). The cursor, not this module, is the data position a checkpoint holds: a
resumed rank asks for exactly the rows that come next.

Evaluation takes whole shards: `evalFraction` of them, chosen with the seed (a dataset of one shard is
read whole and split by rows, as a `path` file is).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.shared.files import atomic_write
from kubetrain.shared.launch import DATA_CACHE_VAR

from .errors import ConfigError, LoadError, TransientError
from .objstore import ObjectStore, ObjectURI, RangeReader, human_bytes, shared_store

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".npz", ".parquet")
# Decoded shards one process keeps in memory: the one it reads, the next, and one evaluation's.
MEMORY_SHARDS = 3
# Shards fetched into the disk cache ahead of the one a rank reads: enough to hide a fetch behind the
# training of one shard, few enough that a small cache is not flushed by what is not needed yet.
PREFETCH_SHARDS = 2
# Parallel header reads while indexing: each is one or two small ranged reads; eight keep a store's
# latency (milliseconds each) from adding up over thousands of shards.
INDEX_THREADS = 8
# Shards in one dataset: each is an index entry and a cache file; more is a listing that is not a dataset.
MAX_SHARDS = 100_000
# The tail of an .npz read to find its members: the zip's end record and central directory (a member's
# entry is under 100 bytes; an .npz holds x and y, numpy writes no comment). A zip with a long comment is
# read again with ZIP_MAX_TAIL_BYTES, the most an end record with its comment can take.
ZIP_TAIL_BYTES = 4 << 10
ZIP_MAX_TAIL_BYTES = 22 + 65535 + 76
# A member's local header and the .npy header after it fit in this (numpy pads headers to 64 bytes, a
# few hundred at most).
NPY_HEADER_BYTES = 4096
INDEX_VERSION = 1


def cache_root() -> Path:
    """The disk cache of dataset shards and downloaded datasets (KUBETRAIN_DATA_CACHE_DIR, which the plan sets;
    unset: ~/.cache/kubetrain/data)."""
    raw = os.environ.get(DATA_CACHE_VAR)
    if raw:
        return Path(raw)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kubetrain" / "data"


# --- where shards come from -------------------------------------------------------------------------


class ShardStorage:
    """A dataset's shards, wherever they lie: their names and sizes, ranged reads, whole fetches."""

    def describe(self, name: str = "") -> str:
        raise NotImplementedError

    def list(self) -> list[tuple[str, int]]:
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        raise NotImplementedError

    def local(self, name: str) -> Path | None:
        """The shard's own file when it is on this machine already (a directory); None: fetch it."""
        return None

    def fetch(self, name: str, path: Path, size: int) -> None:
        raise NotImplementedError


class DirectoryStorage(ShardStorage):
    def __init__(self, path: Path, where: str):
        self.path, self.where = path, where

    def describe(self, name: str = "") -> str:
        return str(self.path / name) if name else f"{self.where}: {self.path}"

    def list(self) -> list[tuple[str, int]]:
        return [(p.name, p.stat().st_size) for p in sorted(self.path.iterdir())
                if p.is_file() and p.name.endswith(SHARD_SUFFIXES)]

    def read_range(self, name: str, start: int, length: int) -> bytes:
        with open(self.path / name, "rb") as f:
            f.seek(start)
            return f.read(length)

    def local(self, name: str) -> Path | None:
        return self.path / name


class ObjectStorage(ShardStorage):
    def __init__(self, prefix: ObjectURI, store: ObjectStore | None = None):
        self.prefix, self.store = prefix.prefix(), store or shared_store()

    def describe(self, name: str = "") -> str:
        return str(self.prefix.child(name)) if name else str(self.prefix)

    def list(self) -> list[tuple[str, int]]:
        return [(info.uri.key[len(self.prefix.key):], info.size) for info in self.store.list(self.prefix)
                if info.uri.key.endswith(SHARD_SUFFIXES)]

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return self.store.get_range(self.prefix.child(name), start, length)

    def fetch(self, name: str, path: Path, size: int) -> None:
        self.store.download(self.prefix.child(name), path, size=size)


# --- the index ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardMeta:
    """One shard as the index knows it: rows, the features' and labels' shapes, the labels' largest value."""

    name: str
    size: int
    rows: int
    x_shape: tuple[int, ...]
    x_dtype: str
    y_shape: tuple[int, ...]
    y_dtype: str
    y_max: float

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "ShardMeta":
        return cls(str(doc["name"]), int(doc["size"]), int(doc["rows"]), tuple(doc["x_shape"]), str(doc["x_dtype"]),
                   tuple(doc["y_shape"]), str(doc["y_dtype"]), float(doc["y_max"]))


RangeRead = Callable[[int, int], "bytes | bytearray"]
"""`read(start, n)`: n bytes of a shard from byte `start` (fewer at its end); a bytearray where the array read
from it should be writable in place."""


class BadShard(Exception):
    """A shard that is not an .npz of x and y, nor a Parquet file of the columns asked for."""


def _zip_members(read: RangeRead, size: int) -> dict[str, tuple[int, int, int]]:
    """{member name: (local header offset, compressed size, method)} from a zip's central directory."""
    tail_start = max(0, size - ZIP_TAIL_BYTES)
    tail = read(tail_start, size - tail_start)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 and size > ZIP_TAIL_BYTES:
        tail_start = max(0, size - ZIP_MAX_TAIL_BYTES)
        tail = read(tail_start, size - tail_start)
        end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) - end < 22:
        raise BadShard("not a zip file (an .npz is one): no end of central directory")
    entries, cd_size, cd_offset = struct.unpack("<10xHII", tail[end:end + 20])[0:3]
    if cd_offset == 0xFFFFFFFF or entries == 0xFFFF:
        # Zip64: numpy writes it for members over 4 GiB; its record sits just before the end record.
        z64 = tail.rfind(b"PK\x06\x06")
        if z64 < 0:
            raise BadShard("a zip64 file without its zip64 end record")
        entries, cd_size, cd_offset = struct.unpack("<32xQQQ", tail[z64:z64 + 56])
    if cd_offset >= tail_start:
        directory = tail[cd_offset - tail_start: cd_offset - tail_start + cd_size]
    else:
        directory = read(cd_offset, cd_size)
    members, pos = {}, 0
    for _ in range(entries):
        if directory[pos:pos + 4] != b"PK\x01\x02":
            raise BadShard("a damaged zip central directory")
        (method, comp, _uncomp, name_len, extra_len, comment_len, offset) = struct.unpack(
            "<10xH8xII HHH8xI", directory[pos:pos + 46])
        name = directory[pos + 46:pos + 46 + name_len].decode(errors="replace")
        extra = directory[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        if 0xFFFFFFFF in (comp, offset):
            comp, offset = _zip64_extra(extra, comp, _uncomp, offset)
        members[name] = (offset, comp, method)
        pos += 46 + name_len + extra_len + comment_len
    return members


def _zip64_extra(extra: bytes | bytearray, comp: int, uncomp: int, offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[pos:pos + 4])
        if tag == 1:
            values = list(struct.unpack(f"<{length // 8}Q", extra[pos + 4:pos + 4 + length // 8 * 8]))
            if uncomp == 0xFFFFFFFF:
                values.pop(0)
            if comp == 0xFFFFFFFF:
                comp = values.pop(0)
            if offset == 0xFFFFFFFF:
                offset = values.pop(0)
            return comp, offset
        pos += 4 + length
    raise BadShard("a zip64 member without its sizes")


def _member_start(read: RangeRead, offset: int) -> tuple[int, bytes | bytearray]:
    """(where the member's data starts, its first bytes) from its local header."""
    head = read(offset, 30 + NPY_HEADER_BYTES)
    if head[:4] != b"PK\x03\x04":
        raise BadShard("a damaged zip member")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    start = offset + 30 + name_len + extra_len
    return start, head[30 + name_len + extra_len:]


NPY_HEADER_LOCK = threading.Lock()
"""numpy reads an .npy header with ast.literal_eval, and CPython 3.11's AST compiler keeps its recursion depth
in state the threads share: headers read at once by the index's threads failed now and then with "SystemError:
AST constructor recursion depth mismatch" (tests/trainer/test_shards.py, 2026-12-06). One header at a time:
microseconds each."""


def _npy_header(data: bytes | bytearray) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header length) of an .npy file's first bytes."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        with NPY_HEADER_LOCK:
            shape, fortran, dtype = read(f)
    except (ValueError, OSError) as err:
        raise BadShard(f"not an .npy array: {err}") from None
    if fortran:
        raise BadShard("a Fortran-ordered array (numpy saves C order unless asked)")
    if dtype.hasobject:
        raise BadShard("holds Python objects (pickled), refused")
    return tuple(shape), dtype, f.tell()


MAX_DEFLATE_RATIO = 1032
"""The most bytes deflate can expand one byte of input to (zlib's own bound: 258-byte matches from 2-bit
codes): a member that declares more than its compressed size times this is lying, and is refused before any
byte is inflated."""


def _npz_member(read: RangeRead, members: dict[str, tuple[int, int, int]], name: str,
                whole: bool) -> tuple[tuple[int, ...], np.dtype, np.ndarray | None]:
    """The shape and dtype of member `name` (`x.npy`), and with `whole` its array.

    The shard is untrusted (anyone who writes the bucket or the directory writes it): its header's shape is
    checked against what the member's bytes can hold before anything is inflated, and inflating stops at the
    size that shape declares, so a small shard never becomes a large allocation (a 509 KiB shard whose y.npy
    inflated to 1 GiB is refused).
    """
    if name not in members:
        raise BadShard(f"has no array {name.removesuffix('.npy')!r} (found "
                       f"{', '.join(sorted(m.removesuffix('.npy') for m in members)) or 'none'})")
    offset, comp, method = members[name]
    start, first = _member_start(read, offset)
    if method not in (0, 8):
        raise BadShard(f"{name}: zip compression method {method} (numpy writes stored or deflated members)")
    try:
        head = zlib.decompressobj(-15).decompress(first, NPY_HEADER_BYTES) if method == 8 else first
    except zlib.error as err:
        raise BadShard(f"{name}: damaged: {err}") from None
    shape, dtype, header = _npy_header(head[:NPY_HEADER_BYTES])
    if not whole:
        return shape, dtype, None
    count = int(np.prod(shape, dtype=object)) if shape else 1
    want = header + count * dtype.itemsize
    most = comp if method == 0 else comp * MAX_DEFLATE_RATIO
    if want > most:
        raise BadShard(f"{name}: its header declares {want} bytes ({shape} of {dtype}), more than its {comp} "
                       f"{'stored' if method == 0 else 'compressed'} bytes can hold")
    raw = read(start, comp)
    if method == 8:
        inflate = zlib.decompressobj(-15)
        try:
            raw = inflate.decompress(raw, want)
            beyond = inflate.decompress(inflate.unconsumed_tail, 1) if len(raw) == want else b""
        except zlib.error as err:
            raise BadShard(f"{name}: damaged: {err}") from None
        if beyond:
            raise BadShard(f"{name}: inflates past the {want} bytes its header declares ({shape} of {dtype}): refused")
    body = memoryview(raw)[header:want]
    if len(body) != count * dtype.itemsize:
        raise BadShard(f"{name}: truncated")
    array = np.frombuffer(body, dtype=dtype).reshape(shape)
    # Writable, as np.load's are (torch warns of a tensor over read-only memory): in place over a bytearray
    # (a stored member read by decode_shard), a copy of what inflating made.
    return shape, dtype, array if array.flags.writeable else array.copy()


@dataclass(frozen=True)
class Columns:
    """Which Parquet columns are the features and which the labels (spec.dataset)."""

    label: str = "label"
    features: tuple[str, ...] = ()


def _parquet_columns(schema: Any, columns: Columns) -> list[str]:
    names = list(schema.names)
    if columns.label not in names:
        raise BadShard(f"has no label column {columns.label!r} (columns: {', '.join(names)}); set "
                       "spec.dataset.labelColumn")
    features = list(columns.features) or [n for n in names if n != columns.label]
    missing = [f for f in features if f not in names]
    if missing:
        raise BadShard(f"has no feature column {missing[0]!r} (columns: {', '.join(names)})")
    if not features:
        raise BadShard("has no feature column besides the labels")
    return features


def parquet_arrays(table: Any, columns: Columns, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a Parquet table: the feature columns stacked (numeric scalars), or one list column's rows."""
    features = _parquet_columns(table.schema, columns)
    try:
        y = table.column(columns.label).to_numpy()
        if len(features) == 1 and str(table.schema.field(features[0]).type).startswith(("fixed_size_list", "list")):
            x = np.stack(table.column(features[0]).to_numpy(zero_copy_only=False)) if table.num_rows else \
                np.zeros((0, 0), np.float32)
        else:
            x = np.stack([table.column(f).to_numpy() for f in features], axis=1)
    except (ValueError, TypeError) as err:  # ArrowInvalid is a ValueError
        raise BadShard(f"{where}: its columns are not numeric features: {err}") from None
    return x, y


def _index_npz(storage: ShardStorage, name: str, size: int) -> ShardMeta:
    def read(start: int, n: int) -> bytes:  # clamped to the object: a header read may reach past a small one
        n = max(0, min(n, size - start))
        return storage.read_range(name, start, n) if n else b""

    members = _zip_members(read, size)
    x_shape, x_dtype, _ = _npz_member(read, members, "x.npy", whole=False)
    y_shape, y_dtype, y = _npz_member(read, members, "y.npy", whole=True)
    assert y is not None
    if not x_shape or not y_shape or x_shape[0] != y_shape[0]:
        raise BadShard(f"x {x_shape} and y {y_shape} must hold the same number of samples along their first axis")
    return ShardMeta(name, size, x_shape[0], x_shape[1:], x_dtype.str, y_shape[1:], y_dtype.str,
                     float(y.max()) if y.size and np.issubdtype(y.dtype, np.number) else 0.0)


def _index_parquet(storage: ShardStorage, name: str, size: int, columns: Columns) -> ShardMeta:
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(io.BufferedReader(RangeReader(lambda s, n: storage.read_range(name, s, n), size),
                                              1 << 20)) as parquet:
            features = _parquet_columns(parquet.schema_arrow, columns)
            labels = parquet.read(columns=[columns.label]).column(columns.label).to_numpy()
            head = parquet.read_row_group(0, columns=features) if parquet.num_row_groups else None
            rows = parquet.metadata.num_rows
    except BadShard:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow's ArrowInvalid, OSError: not a readable Parquet file
        raise BadShard(f"not a readable Parquet file: {type(err).__name__}: {str(err)[:200]}") from None
    if head is not None and head.num_rows:
        import pyarrow as pa

        x, _ = parquet_arrays(pa.table({**{f: head.column(f) for f in features},
                                        columns.label: pa.array(labels[:head.num_rows])}), columns, name)
        x_shape, x_dtype = tuple(x.shape[1:]), x.dtype.str
    else:
        x_shape, x_dtype = (len(features),), "<f4"
    return ShardMeta(name, size, rows, x_shape, x_dtype, tuple(labels.shape[1:]), labels.dtype.str,
                     float(labels.max()) if labels.size and np.issubdtype(labels.dtype, np.number) else 0.0)


def build_index(storage: ShardStorage, columns: Columns, cache: Path | None) -> list[ShardMeta]:
    """Every shard's entry, in name order; read from the cache when the listing (names and sizes) is the same."""
    listing = storage.list()
    if not listing:
        raise LoadError(f"{storage.describe()}: no shards (files ending in {' or '.join(SHARD_SUFFIXES)})")
    if len(listing) > MAX_SHARDS:
        raise LoadError(f"{storage.describe()}: {len(listing)} shards, more than {MAX_SHARDS}; use larger shards")
    key = hashlib.sha256(json.dumps([INDEX_VERSION, storage.describe(), listing, asdict(columns)]).encode()).hexdigest()
    saved = cache / f"index-{key[:24]}.json" if cache is not None else None
    if saved is not None and saved.is_file():
        try:
            return [ShardMeta.from_json(d) for d in json.loads(saved.read_bytes())]
        except (ValueError, KeyError, TypeError):
            pass  # a damaged index is built again

    def one(item: tuple[str, int]) -> ShardMeta:
        name, size = item
        try:
            if name.endswith(".npz"):
                return _index_npz(storage, name, size)
            return _index_parquet(storage, name, size, columns)
        except BadShard as err:
            raise LoadError(f"{storage.describe(name)}: a corrupt or unusable shard: {err}") from None

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(INDEX_THREADS, thread_name_prefix="index") as pool:
        metas = list(pool.map(one, listing))
    log.info("%s: indexed %d shards, %d rows, %s in %.1f s", storage.describe(), len(metas),
             sum(m.rows for m in metas), human_bytes(sum(m.size for m in metas)), time.monotonic() - started)
    if saved is not None:
        try:
            saved.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(saved, json.dumps([asdict(m) for m in metas]).encode())
        except OSError as err:
            log.warning("%s: the index could not be kept (%s); it is built again at the next start", saved, err)
    return metas


# --- the disk cache ---------------------------------------------------------------------------------


class ShardCache:
    """Shards on local disk, at most `max_bytes` of them, the least recently used going first.

    Processes of one node or run share the directory: a shard is fetched to a temporary name and
    renamed (atomic_write), so a reader sees it whole or not at all, and a use touches its time. A shard
    evicted while another process opens it is fetched again there. One larger than the cache is still
    fetched (and is the first to go).
    """

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Event] = {}
        self.hits = self.misses = 0

    def path(self, storage: ShardStorage, name: str) -> Path:
        return self.directory / (hashlib.sha256(storage.describe(name).encode()).hexdigest()[:32]
                                 + Path(name).suffix)

    def get(self, storage: ShardStorage, meta: ShardMeta) -> tuple[Path, bool]:
        """The shard's local file, fetched if needed; (path, whether it was in the cache already)."""
        own = storage.local(meta.name)
        if own is not None:
            return own, True
        path = self.path(storage, meta.name)
        while True:
            with self._lock:
                waiting = self._fetching.get(path.name)
                if waiting is None:
                    if _fresh(path, meta.size):
                        os.utime(path)
                        self.hits += 1
                        return path, True
                    done = self._fetching[path.name] = threading.Event()
                    break
            waiting.wait()  # another thread of this process fetches it: use its result
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._evict(meta.size)
            storage.fetch(meta.name, path, meta.size)
            self.misses += 1
            return path, False
        finally:
            with self._lock:
                del self._fetching[path.name]
            done.set()

    def _evict(self, incoming: int) -> None:
        files = []
        for entry in os.scandir(self.directory):
            if entry.is_file() and not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith("index-"):
                    continue
                files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files) + incoming
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(path)
                total -= size
            except FileNotFoundError:
                pass


def _fresh(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


# --- rows ---------------------------------------------------------------------------------------------


class ShardedRows:
    """The rows of a list of shards (a split: train or eval), read through the cache, a few decoded in memory.

    Row i of the split is row i - offsets[s] of shard s. `rows(indices)` returns (x, y) as the loops take
    them: float32 features, targets as the objective prepared them.
    """

    def __init__(self, storage: ShardStorage, metas: list[ShardMeta], cache: ShardCache, columns: Columns,
                 targets: Callable[[np.ndarray, str], torch.Tensor], on_read: Callable[[str], None] | None = None):
        self.storage, self.metas, self.cache, self.columns = storage, metas, cache, columns
        self.targets, self.on_read = targets, on_read
        self.offsets = np.cumsum([0] + [m.rows for m in metas])
        self._decoded: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._last: tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._prefetcher: _Prefetcher | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def shard_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def rows(self, indices: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the split's rows `indices`, in that order. `key` names the request for the one-entry cache
        (a slice's bounds); by default the indices tensor itself."""
        key = indices if key is None else key
        last = self._last
        # The loop asks for x, then y, of the same batch. The last key is held here, so no other tensor can
        # take its identity (a freed batch's id and memory are reused by the next one).
        if last is not None and (last[0] is key or (isinstance(key, tuple) and last[0] == key)):
            return last[1]
        idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        shards = self.shard_of(idx)
        unique = np.unique(shards)
        if len(unique) == 1:
            x, y = self.decoded(int(unique[0]))
            local = torch.as_tensor(idx - self.offsets[unique[0]])
            result = (x[local], y[local])
        else:
            out_x = out_y = None
            for shard in unique:
                mask = np.nonzero(shards == shard)[0]
                x, y = self.decoded(int(shard))
                local = torch.as_tensor(idx[mask] - self.offsets[shard])
                if out_x is None or out_y is None:
                    out_x = x.new_empty((len(idx), *x.shape[1:]))
                    out_y = y.new_empty((len(idx), *y.shape[1:]))
                out_x[torch.as_tensor(mask)] = x[local]
                out_y[torch.as_tensor(mask)] = y[local]
            assert out_x is not None and out_y is not None
            result = (out_x, out_y)
        self._last = (key, result)
        return result

    def decoded(self, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard `shard`'s (x, y) tensors, from memory or read from the cache (fetched first if need be)."""
        with self._lock:
            if shard in self._decoded:
                self._decoded.move_to_end(shard)
                return self._decoded[shard]
        if self._prefetcher is not None:
            self._prefetcher.reading(shard)
        meta = self.metas[shard]
        path, cached = self.cache.get(self.storage, meta)
        if self.on_read is not None:
            self.on_read("cache" if cached else "store")
        where = self.storage.describe(meta.name)
        try:
            x, y = decode_shard(path, self.columns, where)
        except BadShard as err:
            raise LoadError(f"{where}: a corrupt or unusable shard: {err}") from None
        if len(x) != meta.rows or tuple(x.shape[1:]) != meta.x_shape:
            raise LoadError(f"{where}: changed since it was indexed ({len(x)} rows of {tuple(x.shape[1:])}, the "
                            f"index says {meta.rows} of {meta.x_shape}); a dataset must not change during a job")
        tensors = (torch.as_tensor(np.asarray(x, dtype=np.float32)), self.targets(np.asarray(y), where))
        with self._lock:
            self._decoded[shard] = tensors
            while len(self._decoded) > MEMORY_SHARDS:
                self._decoded.popitem(last=False)
        return tensors

    def plan(self, indices: torch.Tensor) -> None:
        """The order in which this process will read the split's rows (an epoch's share): the shards in the
        order of their first row are fetched PREFETCH_SHARDS ahead of the one being read."""
        if self.storage.local(self.metas[0].name) is not None:
            return  # a directory's shards need no fetch
        idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        shards = self.shard_of(idx)
        _, first = np.unique(shards, return_index=True)
        sequence = [int(s) for s in shards[np.sort(first)]]
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self)
        self._prefetcher.follow(sequence)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()


class _Prefetcher:
    """A thread that fetches, into the disk cache, the next PREFETCH_SHARDS shards of a rank's sequence."""

    def __init__(self, rows: ShardedRows):
        self.rows = rows
        self.sequence: list[int] = []
        self.position = 0
        self._wake = threading.Condition()
        self._stopped = False
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self._thread.start()

    def follow(self, sequence: list[int]) -> None:
        with self._wake:
            self.sequence, self.position = sequence, 0
            self._wake.notify()

    def reading(self, shard: int) -> None:
        with self._wake:
            if shard in self.sequence[self.position:]:
                self.position = self.sequence.index(shard, self.position)
                self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _next(self) -> int | None:
        for shard in self.sequence[self.position + 1:self.position + 1 + PREFETCH_SHARDS]:
            meta = self.rows.metas[shard]
            if not _fresh(self.rows.cache.path(self.rows.storage, meta.name), meta.size):
                return shard
        return None

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (shard := self._next()) is None:
                    self._wake.wait()
                if self._stopped or shard is None:
                    return
            try:
                self.rows.cache.get(self.rows.storage, self.rows.metas[shard])
            except (LoadError, TransientError, OSError) as err:
                # The reader fetches it itself and fails there, with the error in its own thread.
                log.warning("prefetch of %s failed (%s); it is fetched when it is read",
                            self.rows.storage.describe(self.rows.metas[shard].name), err)
                with self._wake:
                    self._wake.wait(5.0)


def read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """x and y of an .npz file, through the index's bounded reader (_npz_member), not np.load: numpy allocates
    what a member's header declares and zipfile inflates what its directory declares, both written by whoever
    wrote the file. BadShard naming the fault."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def read(start: int, n: int) -> bytearray:
                buffer = bytearray(max(0, min(n, size - start)))
                got = os.preadv(f.fileno(), [buffer], start) if buffer else 0
                return buffer if got == len(buffer) else buffer[:got]

            members = _zip_members(read, size)
            _, _, x = _npz_member(read, members, "x.npy", whole=True)
            _, _, y = _npz_member(read, members, "y.npy", whole=True)
    except OSError as err:
        raise BadShard(f"cannot be read: {err.strerror or err}") from None
    except struct.error as err:
        raise BadShard(f"a damaged zip file: {err}") from None
    assert x is not None and y is not None
    return x, y


def decode_shard(path: Path, columns: Columns, where: str) -> tuple[np.ndarray, np.ndarray]:
    if path.name.endswith(".npz"):
        return read_npz(path)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001
        raise BadShard(f"not a readable Parquet file: {type(err).__name__}: {str(err)[:200]}") from None
    return parquet_arrays(table, columns, where)


class LazyRows:
    """`x` or `y` of a sharded split, as the loops index a tensor: `rows[indices]`, `rows[a:b]`, `len(rows)`,
    `.to(device)` (rows land on that device when read)."""

    def __init__(self, source: ShardedRows, which: int, device: Any = None):
        self.source, self.which, self.device = source, which, device

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, slice):
            bounds = key.indices(len(self))
            out = self.source.rows(torch.arange(*bounds), key=("slice", *bounds))[self.which]
        else:
            out = self.source.rows(key.cpu() if isinstance(key, torch.Tensor) else torch.as_tensor(key))[self.which]
        return out.to(self.device) if self.device is not None else out

    def to(self, device: Any) -> "LazyRows":
        return LazyRows(self.source, self.which, device)


# --- the order ------------------------------------------------------------------------------------------


class ShardOrder:
    """An epoch's order of a sharded split's rows, dealt by shard: rank r of `lanes` gets whole shards.

    Shards are shuffled with `seed + epoch` and dealt to the lane holding the fewest rows so far; each
    shard's rows are shuffled; lane r's rows fill positions r, r + lanes, r + 2 lanes, ... until the
    shortest lane ends, and what the longer lanes hold beyond it comes last. Every row appears exactly
    once, whatever `lanes` is; the same epoch and lanes give the same order on every process.
    """

    def __init__(self, shard_rows: Sequence[int], seed: int):
        self.shard_rows = list(shard_rows)
        self.offsets = np.cumsum([0] + self.shard_rows)
        self.seed = seed

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def order(self, epoch: int, lanes: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        shards = torch.randperm(len(self.shard_rows), generator=generator).tolist()
        filled = [0] * lanes
        parts: list[list[torch.Tensor]] = [[] for _ in range(lanes)]
        for shard in shards:
            lane = min(range(lanes), key=lambda r: (filled[r], r))
            rows = torch.randperm(self.shard_rows[shard], generator=generator) + int(self.offsets[shard])
            parts[lane].append(rows)
            filled[lane] += self.shard_rows[shard]
        lane_rows = [torch.cat(p) if p else torch.empty(0, dtype=torch.long) for p in parts]
        shortest = min(len(r) for r in lane_rows)
        head = torch.stack([r[:shortest] for r in lane_rows], dim=1).reshape(-1) if shortest else \
            torch.empty(0, dtype=torch.long)
        tail = torch.cat([r[shortest:] for r in lane_rows])
        return torch.cat([head, tail])


def parse_quantity(text: str, where: str) -> int:
    """Bytes of a Kubernetes quantity (`10Gi`, `500M`, `1024`)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", text)
    if match is None:
        raise ConfigError(f"{where}: expected a quantity such as 10Gi, got {text!r}")
    units = {None: 1, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
    return int(float(match.group(1)) * units[match.group(2)])


def eval_shards(count: int, fraction: float, seed: int) -> set[int]:
    """Which of `count` shards are held out for evaluation: round(fraction x count), at least one when the
    fraction is above 0 and there are two shards or more, never all; chosen with the seed."""
    if count < 2 or fraction <= 0:
        return set()
    n = min(count - 1, max(1, round(fraction * count)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return set(order[:n])


def check_shapes(metas: list[ShardMeta], storage: ShardStorage) -> None:
    """Every shard holds the same features' and targets' shapes: else LoadError naming the first that differs."""
    first = metas[0]
    for meta in metas[1:]:
        if meta.x_shape != first.x_shape or meta.y_shape != first.y_shape:
            raise LoadError(f"{storage.describe(meta.name)}: x of {meta.x_shape} and y of {meta.y_shape} per sample, "
                            f"but {storage.describe(first.name)} holds {first.x_shape} and {first.y_shape}: every "
                            "shard must hold samples of one shape")
