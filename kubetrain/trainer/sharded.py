"""Sharded checkpoints: every rank writes its own shards, one commit makes them a checkpoint.

A state whose tensors are DTensors (FSDP2, tensor parallel: what
`torch.distributed.checkpoint.state_dict.get_state_dict` returns) is never
gathered onto one rank. `ShardedStore.save` is collective: every rank copies
its own shards into host memory (the only part the training loop waits for)
and a writer thread per rank writes them through torch.distributed.checkpoint
(DCP), fsyncs them, reads them back and hashes them. Rank 0 gathers every
rank's list of files with their length and sha256, writes it as `COMMIT`, and
only then renames the directory to its final name and moves `latest`: a
checkpoint exists once every rank's files are durable and verified, and one
rename marks it whole.

Layout, in the job's checkpoint directory (shared by every rank of the job),
beside the plain `ckpt-<step>.pt` files of checkpoint.py:

    .sharded-<step:08d>-<token>.tmp/   a save in flight (or one a crash cut short)
    sharded-<step:08d>/                a complete checkpoint: DCP's files and COMMIT
    sharded-<step:08d>.corrupt/        one that failed its checks at a restore, set aside
    latest                             the newest complete checkpoint's name, plain or sharded

A rank killed in the middle of a save leaves a `.tmp` directory without
COMMIT: never restored, removed by rank 0 at the next restore (when no save is
in flight anywhere) and after each later commit.

`restore` is collective too: rank 0 names the newest complete checkpoint, the
ranks check its files between them (rank r hashes every world-size-th file),
and DCP loads it into the caller's template in place, each rank reading only
the pieces its own shards need, resharded to the current world size.

Collectives of this module run on a process group of their own (gloo, made at
the first save or restore): the writer threads gather while the training loop
runs its own collectives on the default group, and two threads must never
share one group's sequence of collectives.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kubetrain.shared.checkpoints import (COMMIT, CORRUPT_SUFFIX, LATEST, SHARDED_PATTERN, SHARDED_TMP_PATTERN,
                                          sharded_name, sharded_tmp_name)
from kubetrain.shared.files import PLAIN_NAME, OutsideFolder, atomic_write, confined, fsync_dir, read_regular, unreadable
from kubetrain.api.identity import JobIdentity

from . import dcp_reader
from .checkpoint import CheckpointInfo, Records, Store, Written, another_spec, drop_cache
from .errors import ConfigError, TransientError

log = logging.getLogger(__name__)

COMMIT_VERSION = 1
# DCP's own names: one data file per rank (single_file_per_rank) and the
# coordinator's index of every piece.
METADATA = dcp_reader.METADATA
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
RANK_FILE = re.compile(r"__([0-9]+)_([0-9]+)\.distcp")
# The largest COMMIT read back: it lists a file per rank (about 120 bytes
# each), so 4 MiB holds some 30,000 ranks; anything larger is not ours.
MAX_COMMIT_BYTES = 4 << 20
# Reads of the hash passes, as checkpoint.VERIFY_CHUNK_BYTES: hashing dominates
# the per-call cost, and no second copy of a shard is held.
HASH_CHUNK_BYTES = 8 << 20


class ShardedCheckpointError(ConfigError):
    """A sharded checkpoint that cannot be used as asked (no template, a template that does not match, storage
    that not every rank can read); exit 2, a permanent failure."""


@dataclass(frozen=True)
class Commit(Records):
    """What COMMIT records: the step, the job it was written for (kubetrain.api.identity: its hash, and since
    0.2.0 its identity and the release), and every file with its length and sha256."""

    written: Written
    world_size: int
    files: dict[str, tuple[int, str]]

    @property
    def lengths(self) -> dict[str, int]:
        return {name: n for name, (n, _) in self.files.items()}

    def to_json(self) -> bytes:
        return json.dumps({"version": COMMIT_VERSION, **self.written.to_json(), "world_size": self.world_size,
                           "files": {name: {"length": n, "sha256": h} for name, (n, h) in sorted(self.files.items())}},
                          indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, raw: bytes) -> "Commit":
        """A COMMIT's bytes (untrusted: a shared claim); CorruptSharded naming the fault."""
        if len(raw) > MAX_COMMIT_BYTES:
            raise CorruptSharded(f"COMMIT is larger than {MAX_COMMIT_BYTES} bytes")
        try:
            doc = json.loads(raw)
            written = Written.from_json(doc)
            files = {name: (f["length"], f["sha256"]) for name, f in doc["files"].items()}
            world_size = doc["world_size"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise CorruptSharded(f"COMMIT is unreadable: {type(err).__name__}: {str(err)[:200]}") from None
        if type(world_size) is not int or world_size < 1:
            raise CorruptSharded(f"COMMIT gives a world size of {world_size!r}")
        for name, (length, digest) in files.items():
            if PLAIN_NAME.fullmatch(name) is None:
                raise CorruptSharded(f"COMMIT lists {name[:100]!r}, which is not a plain file name (refused: a name "
                                     "with '/' or '..' would lead outside the checkpoint)")
            if type(length) is not int or length < 0 or not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
                raise CorruptSharded(f"COMMIT gives {name} a length {length!r} and sha256 {str(digest)[:70]!r}")
        return cls(written, world_size, files)

    @classmethod
    def read(cls, directory: Path) -> "Commit":
        """The COMMIT of `directory`; CorruptSharded when it is missing, not a regular file or unreadable."""

        try:
            raw = read_regular(directory / COMMIT, MAX_COMMIT_BYTES + 1)
        except FileNotFoundError:
            raise CorruptSharded("no COMMIT (the save did not finish)") from None
        except OSError as err:
            raise CorruptSharded(f"COMMIT {unreadable(err)}") from None
        return cls.parse(raw)


class CorruptSharded(Exception):
    """A sharded checkpoint whose COMMIT or files fail their checks."""


def has_dtensors(state: Any, depth: int = 0) -> bool:
    """Whether any leaf of `state` is a DTensor (then the state is sharded and every rank saves its part)."""
    from torch.distributed.tensor import DTensor

    stack = [(state, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, DTensor):
            return True
        if level >= 64:  # userapi.MAX_STATE_DEPTH refuses deeper states before this runs
            continue
        if isinstance(value, dict):
            stack.extend((v, level + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, level + 1) for v in value)
    return False


def hash_file(path: Path) -> tuple[int, str]:
    """(length, sha256) of a file as the device holds it: cached pages dropped before and after the read.

    Run on a file just fsynced, this is the read-back that proves it durable
    as written; the dropped pages also keep a large shard out of the page
    cache (in a pod it counts towards the memory limit).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        drop_cache(fd)
        sha, length = hashlib.sha256(), 0
        with os.fdopen(fd, "rb", closefd=False) as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                sha.update(chunk)  # hashlib releases the GIL for large buffers: training goes on
                length += len(chunk)
        drop_cache(fd)
        return length, sha.hexdigest()
    finally:
        os.close(fd)


def rank_files(directory: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote in a DCP directory (the coordinator, rank 0, also wrote .metadata)."""
    names = [p.name for p in directory.iterdir()
             if (m := RANK_FILE.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0 and (directory / METADATA).exists():
        names.append(METADATA)
    return sorted(names)


def complete(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete sharded checkpoints in `directory` (a COMMIT present), oldest first.

    Not verified: `verify` checks a candidate's files.
    """
    found = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        match = SHARDED_PATTERN.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and (path / COMMIT).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def verify(path: Path, commit: Commit, names: list[str] | None = None) -> None:
    """Check the files of a committed checkpoint (all, or `names` among them); CorruptSharded if one differs."""
    import stat

    for name in names if names is not None else sorted(commit.files):
        length, digest = commit.files[name]
        try:
            file = confined(path, name)
        except OutsideFolder as err:
            raise CorruptSharded(str(err)) from None
        try:
            info = file.lstat()
        except FileNotFoundError:
            raise CorruptSharded(f"{name} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise CorruptSharded(f"{name} is not a regular file (a link or FIFO), refused")
        if info.st_size != length:
            raise CorruptSharded(f"{name} is {info.st_size} bytes, COMMIT says {length} (truncated?)")
        if hash_file(file)[1] != digest:
            raise CorruptSharded(f"{name}: sha256 differs from COMMIT")


class ShardedStore(Store):
    """The sharded checkpoints of one job, as one rank sees them: collective saves and restores.

    `directory` must be the same directory on every rank (one volume every
    node mounts: checkpoint.storage.accessMode ReadWriteMany in a cluster).
    `on_persisted(info, seconds)` runs on rank 0 once a checkpoint is committed
    (in its writer thread). `timeout` bounds every collective of the store: a
    rank that dies in the middle of a save leaves the others' writer threads
    waiting for it at most that long (the save then fails with TransientError,
    raised by the next `save` or `wait`).
    """

    def __init__(self, directory: str | Path, keep_last: int, identity: JobIdentity | str, *,
                 timeout: timedelta = timedelta(minutes=10),
                 on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
                 mid_save: Callable[[int], None] | None = None):
        super().__init__(directory, keep_last, identity, on_persisted, mid_save)
        self.timeout = timeout
        self._group: Any = None
        self._stager: Any = None
        self._unusable: set[str] = set()
        """Rank 0: checkpoints found damaged that could not be renamed (a read-only volume): never tried again
        by this process, never deleted."""

    # --- the group ---------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def group(self) -> Any:
        """The store's own gloo group (collective: every rank makes it at the same call), None when alone."""
        if not self.distributed:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
            _settle_before_destroy(self)
        return self._group

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group())
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group())
        return out

    # --- save --------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank: copy this rank's shards into memory now; write, verify and commit in the background.

        Returns once the copy is made. At most one save is in flight: a save
        while the previous one is being written waits for it (counted in
        `stall_seconds`) and raises its failure as TransientError.
        """
        started = time.perf_counter()
        self.wait()
        group = self.group()
        # Rank 0 names the directory. It has finished its previous commit and
        # pruning by now (its wait above), so nothing it prunes can be a
        # directory another rank is starting to write.
        token = self._broadcast(secrets.token_hex(6) if self.rank == 0 else None)
        tmp = self.directory / sharded_tmp_name(step, token)
        staged = self._stage(state)
        self._thread = threading.Thread(target=self._persist, args=(step, staged, tmp, group),
                                        name=f"sharded-checkpoint-{step}")
        self._thread.start()
        self.stall_seconds = time.perf_counter() - started

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state` in host memory, into buffers kept from the previous save (DCP's own stager).

        Refilling the last save's buffers is safe: `save` waited for the
        write that read them. One copy of this rank's shards stays in host
        memory for the life of the store, as checkpoint.SnapshotBuffers does.
        """
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager.stage(state)

    def settle(self) -> None:
        """Block until this rank's part of the last save is done; a failure stays for `wait` to raise."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Block until this rank's part of the last save is done; TransientError if the save failed."""
        self.settle()
        if self._error is not None:
            err, self._error = self._error, None
            raise TransientError(f"sharded checkpoint in {self.directory}: could not be written: {err}") from err

    def _persist(self, step: int, staged: dict[str, Any], tmp: Path, group: Any) -> None:
        """Write this rank's shards, read them back; rank 0 commits once every rank has. In the writer thread."""
        import torch.distributed.checkpoint as dcp

        started = time.monotonic()
        mine: dict[str, tuple[int, str]] | str
        try:
            writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
            with alone_is_meant():
                dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)
            mine = {name: hash_file(tmp / name) for name in rank_files(tmp, self.rank)}
            if self.mid_save is not None:
                self.mid_save(step)
        except BaseException as err:  # noqa: BLE001 - told to rank 0 below, raised by this rank's next save
            self._error = err
            mine = f"rank {self.rank}: {type(err).__name__}: {err}"
        try:
            everyone = self._gather(mine, group)
            if self.rank == 0:
                self._commit(step, tmp, everyone, started)
        except BaseException as err:  # noqa: BLE001 - the training thread sees it in wait()
            self._error = self._error or err

    def _gather(self, mine: Any, group: Any) -> list[Any]:
        if group is None:
            return [mine]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=group)
        return out or []

    @staticmethod
    def merged(step: int, everyone: list[Any]) -> dict[str, tuple[int, str]]:
        """Every rank's files (name: (length, sha256)) of one save, merged; TransientError when a rank failed
        (its message instead of its files) or no rank wrote DCP's METADATA: then nothing may be committed."""
        failed = [m for m in everyone if isinstance(m, str)]
        if failed:
            raise TransientError(f"step {step} not committed: {'; '.join(failed)}")
        files: dict[str, tuple[int, str]] = {}
        for part in everyone:
            files.update(part)
        if not any(name.rsplit("/", 1)[-1] == METADATA for name in files):
            raise TransientError(f"step {step} not committed: DCP wrote no {METADATA}")
        return files

    def _commit(self, step: int, tmp: Path, everyone: list[Any], started: float) -> None:
        files = self.merged(step, everyone)
        commit = Commit(Written.of(step, self.identity), len(everyone), files)
        atomic_write(tmp / COMMIT, commit.to_json())
        final = self.directory / sharded_name(step)
        if final.exists():  # the same step saved again (a resumed script): the new one replaces it whole
            old = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.directory)
        atomic_write(self.directory / LATEST, final.name.encode() + b"\n")
        self.durable_step = step
        self._prune(step)
        if self.on_persisted is not None:
            size = sum(n for n, _ in files.values())
            self.on_persisted(CheckpointInfo(step, final, size), time.monotonic() - started)

    def _prune(self, committed: int) -> None:
        """Rank 0, after a commit: complete checkpoints beyond keepLast, and saves older than `committed` that
        never finished. A failed deletion must not fail the checkpoint just committed; the next commit tries
        again."""
        doomed = [path for _, path in complete(self.directory)[: -self.keep_last]]
        for path in self.directory.iterdir():
            match = SHARDED_TMP_PATTERN.fullmatch(path.name)
            if match and int(match.group(1)) < committed:
                doomed.append(path)
        for path in doomed:
            try:
                shutil.rmtree(path)
            except OSError as err:
                log.warning("sharded checkpoint %s: could not be deleted: %s", path, err)

    def remove_incomplete(self) -> None:
        """Rank 0, when no save is in flight on any rank (a restore): every save a crash cut short goes."""
        if self.rank != 0:
            return
        for path in list(self.directory.iterdir()) if self.directory.is_dir() else []:
            if SHARDED_TMP_PATTERN.fullmatch(path.name) or path.name.endswith(".old"):
                log.warning("sharded checkpoint %s never completed (a rank stopped in the middle of the save); "
                            "removed", path)
                shutil.rmtree(path, ignore_errors=True)

    # --- restore -----------------------------------------------------------------

    def newest(self) -> tuple[int, Path] | None:
        """Every rank: (step, path) of the newest complete checkpoint whose files all verify; None if none.

        Rank 0 names a candidate, every rank hashes its share of the files
        (rank r every world-size-th) and reads DCP's `.metadata` through the
        restricted reader (dcp_reader), and a candidate any rank finds damaged
        is set aside as `.corrupt` by rank 0 (kept, never deleted) and the
        previous one tried. A checkpoint of another job's spec is refused with
        ConfigError, before anything in the directory is touched; saves cut
        short are removed only once the directory is known to be this job's.
        """
        while True:
            candidate = None
            if self.rank == 0:
                found = [(step, path) for step, path in complete(self.directory) if path.name not in self._unusable]
                candidate = (found[-1][0], str(found[-1][1])) if found else None
            candidate = self._broadcast(candidate)
            if candidate is None:
                self.remove_incomplete()
                return None
            step, path = candidate[0], Path(candidate[1])
            problem = self._check(path)
            problems = [p for p in self._all_gather(problem) if p]
            if not problems:
                self.remove_incomplete()
                self.durable_step = step
                return step, path
            if self.rank == 0:
                self.set_aside_dir(path, "; ".join(problems))
            if self.distributed:
                dist.barrier(group=self.group())

    def set_aside_dir(self, path: Path, reason: str) -> None:
        """Rank 0: a damaged sharded checkpoint renamed `.corrupt` (kept for a person to look at), or, where it
        cannot be renamed, remembered as unusable for this process's life; never deleted."""
        log.warning("sharded checkpoint %s is unusable (%s); falling back to the previous one", path, reason)
        self.set_aside_log.append((str(path), reason))
        try:
            os.rename(path, path.with_name(path.name + CORRUPT_SUFFIX))
        except OSError:
            self._unusable.add(path.name)

    def _check(self, path: Path) -> str | None:
        try:
            commit = Commit.read(path)
            named = SHARDED_PATTERN.fullmatch(path.name)
            if named and int(named.group(1)) != commit.step:
                raise CorruptSharded(f"its COMMIT says step {commit.step}, its name step {int(named.group(1))}")
        except CorruptSharded as err:
            return str(err)
        verdict = commit.written.judge(self.identity)
        if not verdict.ok:
            raise another_spec(path, verdict, f"Delete {self.directory} or use a new run directory")
        names = sorted(commit.files)[self.rank :: self.world_size]
        try:
            verify(path, commit, names)
            check_contents(dcp_reader.Reader(path, commit.lengths), commit, names)
        except CorruptSharded as err:
            return str(err)
        return None

    def load(self, path: Path, template: dict[str, Any]) -> None:
        """Every rank: load checkpoint `path` into `template` in place, each rank reading only its pieces."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            reader = dcp_reader.Reader(path, Commit.read(path).lengths)
            with alone_is_meant():
                dcp_reader.load(template, reader, self.group(), no_dist=not self.distributed)
        except CorruptSharded:
            raise
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            raise unfit(path, err) from None

    def load_or_set_aside(self, path: Any, template: dict[str, Any]) -> bool:
        """Every rank: `load` checkpoint `path` into `template`; True once every rank has. A checkpoint whose pieces
        do not load on some rank (bytes that verify against a commit its writer rewrote too) is set aside by
        rank 0, kept, and False returned on every rank: the caller takes the one before (`newest` again)."""
        problem = None
        try:
            self.load(path, template)
        except CorruptSharded as err:
            problem = f"rank {self.rank}: {err}"
        problems = [p for p in self._all_gather(problem) if p]
        if not problems:
            return True
        if self.rank == 0:
            self.set_aside_dir(path, "; ".join(problems))
        if self.distributed:
            dist.barrier(group=self.group())
        return False


_STORES: "weakref.WeakSet[ShardedStore]" = weakref.WeakSet()


def _settle_before_destroy(store: ShardedStore) -> None:
    """Make `torch.distributed.destroy_process_group` wait for `store`'s save in flight first.

    A script's last `kubetrain.save` returns with its shards still being
    written, and the script's next line is often `dist.destroy_process_group()`,
    which would destroy the store's group under the writer thread's collectives
    (seen: "Group ... is not registered", the last checkpoint lost, exit 75).
    So the first store wraps the function once: it settles every store's
    save in flight (a failure stays for the exit, which then fails with 75),
    then destroys. A name imported before the first save
    (`from torch.distributed import destroy_process_group`) is not wrapped:
    call `kubetrain.save(..., wait=True)` for the last save then.
    """
    _STORES.add(store)
    for module in (dist, dist.distributed_c10d):
        original = module.destroy_process_group
        if getattr(original, "_kubetrain_settles", False):
            continue

        def destroy_process_group(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            for pending in list(_STORES):
                pending.settle()
            return __original(*args, **kwargs)

        destroy_process_group._kubetrain_settles = True  # type: ignore[attr-defined]
        destroy_process_group.__doc__ = original.__doc__
        module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]  # torch's function, patched


def fill_template(template: Any, state: Any, path: str = "") -> Any:
    """Copy a plain (whole) `state` into `template` in place: a DTensor leaf takes its own shard of the whole
    tensor, a plain tensor the tensor, any other leaf the value; returns the template.

    How a checkpoint written whole (before the model was sharded) restores into a sharded model.
    ShardedCheckpointError names the first path where the two differ.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(template, dict):
        if not isinstance(state, dict):
            raise _mismatch(path, "a dict", state)
        missing = [k for k in template if k not in state]
        if missing:
            raise ShardedCheckpointError(f"kubetrain.restore: the checkpoint has no {path}[{missing[0]!r}] that the "
                                         "template has")
        for key in template:
            template[key] = fill_template(template[key], state[key], f"{path}[{key!r}]")
        return template
    if isinstance(template, list):
        if not isinstance(state, (list, tuple)) or len(state) != len(template):
            raise _mismatch(path, f"a list of {len(template)}", state)
        for i, item in enumerate(template):
            template[i] = fill_template(item, state[i], f"{path}[{i}]")
        return template
    if isinstance(template, torch.Tensor):
        if not isinstance(state, torch.Tensor):
            raise _mismatch(path, "a tensor", state)
        if tuple(template.shape) != tuple(state.shape):
            raise ShardedCheckpointError(f"kubetrain.restore: state{path} has shape {tuple(state.shape)} in the "
                                         f"checkpoint, {tuple(template.shape)} in the template")
        with torch.no_grad():
            if isinstance(template, DTensor):
                # Every rank holds the whole tensor here: each cuts its own shard, no communication.
                mine = distribute_tensor(state.to(template.dtype), template.device_mesh, template.placements,
                                         src_data_rank=None)
                template.to_local().copy_(mine.to_local())
            else:
                template.copy_(state)
        return template
    return state


def _mismatch(path: str, expected: str, got: Any) -> ShardedCheckpointError:
    return ShardedCheckpointError(f"kubetrain.restore: state{path or ''} is {expected} in the template, a "
                                  f"{type(got).__name__} in the checkpoint")


def cause_of(err: BaseException) -> str:
    """The message of what failed: DCP's CheckpointException wraps each rank's exception with its traceback."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, its traceback's frames)
        lines = str(inner).strip().splitlines()
        return f"rank {rank}: {type(inner).__name__}: {lines[-1] if lines else ''}"
    lines = str(err).strip().splitlines()
    return lines[-1] if lines else type(err).__name__


def _inner(err: BaseException) -> BaseException:
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = sorted(failures.items())[0][1]
        return failure[0] if isinstance(failure, tuple) else failure
    return err


def unfit(where: object, err: BaseException) -> Exception:
    """A load of a verified checkpoint that failed: CorruptSharded when a piece's bytes do not load as a tensor
    or value (pickled code refused by the weights-only loader, a piece not of the size its metadata says: a
    writer that rewrote the commit too), so that the restore sets it aside; else ShardedCheckpointError (the
    template given does not fit the state saved, exit 2)."""
    import pickle
    import zipfile

    inner = _inner(err)
    text = str(inner).strip().splitlines()
    if isinstance(inner, (pickle.UnpicklingError, EOFError, AssertionError, zipfile.BadZipFile)) or (
            isinstance(inner, RuntimeError) and "PytorchStreamReader" in str(inner)):
        return CorruptSharded(f"a piece does not load: {type(inner).__name__}: {text[0][:200] if text else ''}")
    return ShardedCheckpointError(
        f"kubetrain.restore: the checkpoint {where} does not fit the template given: {cause_of(err)}. Pass a template "
        "of the same structure as the state saved (for a model and optimizer: get_state_dict(model, optimizer) after "
        "building and sharding them)")


# --- read-only access, for tools (export, verify) that read a copy they do not own -----------------------


def check(path: Path, expected: JobIdentity | None = None) -> Commit:
    """The COMMIT of checkpoint directory `path` once every file it lists verifies and its `.metadata` reads
    as DCP's (dcp_reader); CorruptSharded if not.

    Reads only; nothing is renamed (the copy may be read-only). `expected`: a
    COMMIT of another job's spec is CorruptSharded too ("written for another job").
    """
    commit = Commit.read(path)
    match = SHARDED_PATTERN.fullmatch(path.name)
    if match and int(match.group(1)) != commit.step:
        raise CorruptSharded(f"its COMMIT says step {commit.step}, its name step {int(match.group(1))}")
    if expected is not None:
        verdict = commit.written.judge(expected)
        if not verdict.ok:
            raise CorruptSharded(f"written for another job: {verdict.reason}")
    verify(path, commit)
    check_contents(dcp_reader.Reader(path, commit.lengths), commit)
    return commit


def check_contents(reader: Any, commit: Commit, names: list[str] | None = None) -> None:
    """What a hash cannot tell (a writer of the directory or bucket rewrites a commit too): `.metadata` reads as
    DCP's metadata of the commit's files (dcp_reader: nothing unpickled), and every non-tensor value in `names`
    (all files when None) loads weights-only; CorruptSharded naming the fault."""
    if METADATA not in commit.files:
        raise CorruptSharded(f"COMMIT lists no {METADATA}")
    try:
        metadata = reader.read_metadata()
        dcp_reader.check_values(reader, metadata, names)
    except dcp_reader.MetadataError as err:
        raise CorruptSharded(f"{METADATA}: {err}") from None


def incomplete(directory: Path) -> list[Path]:
    """Saves in `directory` that never completed (no COMMIT): never restored, removed at the next start."""
    try:
        return sorted(p for p in directory.iterdir() if SHARDED_TMP_PATTERN.fullmatch(p.name))
    except FileNotFoundError:
        return []


def load_whole(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Every tensor of checkpoint `path` (under `keys` only, when given) whole, in one process (export, verify's
    eval): the model gathered. Plain tensors, nested as saved, read through dcp_reader (nothing unpickled)."""
    reader = dcp_reader.Reader(path, Commit.read(path).lengths)
    with alone_is_meant():
        return dcp_reader.load_whole(reader, keys)


@contextlib.contextmanager
def alone_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*(unavailable|uninitialized)")
        yield
