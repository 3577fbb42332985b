"""Checkpoints owned by the system: atomic, verifiable files, resumed from on every start.

A checkpoint file is `ckpt-<step:08d>.pt`: a magic line, a JSON header line
(step, the job's identity and spec hash (kubetrain.api.identity), the release
that wrote it, payload length and sha256), then the `torch.save` payload.
A file is written under a temporary name, fsynced, read back and checked
(length and sha256), renamed, and only then does the `latest` pointer move
and is the checkpoint reported (`on_persisted`), so a crash at any moment
leaves either the old or the new checkpoint whole, and a reported step always
names a durable, verified file. A file that still fails its length or
checksum at the next start (a torn copy, a bad disk) is set aside and the
previous one is used.

Saves are off the training loop's critical path: `save` copies the state into
host buffers kept from the previous save and returns; serialising, hashing,
writing, fsync and the read-back run in a writer thread, at most one at a time.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from kubetrain.shared import __version__
from kubetrain.shared.checkpoints import CORRUPT_SUFFIX, FILE_PATTERN, FILE_TMP_GLOB, LATEST, file_name, read_latest
from kubetrain.shared.files import atomic_write, read_regular, unreadable
from kubetrain.api.identity import JobIdentity, Verdict

from .errors import ConfigError, TransientError

log = logging.getLogger(__name__)

MAGIC = b"KUBETRAIN-CKPT-1\n"
# The header line is padded with spaces to a multiple of this many bytes (newline included): the payload
# streams into the file past a placeholder, and the header, whose length and sha256 are known only then,
# is written over it. Its room is reckoned before the payload from everything else it holds (the job's
# identity is most of it: a few hundred bytes, more with a model's args), with the widest length and
# digest. Readers take the line as it is (JSON allows trailing spaces), so files with the earlier,
# unpadded header and 0.1.0's 512 bytes still load, and 0.1.0 reads these.
HEADER_BYTES = 512
MAX_HEADER_BYTES = 1 << 20
"""The longest header line read back: the identity of a spec within the CRD's bounds is far shorter; a
longer line is not a header kubetrain wrote."""
# Reads of the verification pass: large enough that hashing dominates the
# per-call cost, small enough not to hold a second copy of a large checkpoint.
VERIFY_CHUNK_BYTES = 8 << 20
# Leaves of a state that need no copy: immutable (the RNG state's tuples of
# ints, numbers, names). Anything else is deep-copied by the snapshot.
IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)

def capture_rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and Python RNG states, in types `torch.load(weights_only=True)` accepts."""
    rng: Any = np.random.get_state()  # the legacy tuple: (name, keys, pos, has_gauss, cached)
    name, keys, pos, has_gauss, cached = rng
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def another_spec(where: object, verdict: Verdict, remedy: str) -> ConfigError:
    """A checkpoint written for another spec: resuming it would mix two different jobs (exit 2)."""
    return ConfigError(f"checkpoint {where} was written for a different spec: {verdict.reason}. A change of the "
                       f"model, dataset, training or topology does not resume: {remedy} to start over")


@dataclass(frozen=True)
class Written:
    """What a checkpoint says of the job it was written for: its step, spec hash, identity (None in those of
    0.1.0 and earlier, which hold a hash only) and the release that wrote it ("" for 0.1.0 and earlier)."""

    step: int
    spec_hash: str
    identity: dict[str, Any] | None = None
    release: str = ""

    def to_json(self) -> dict[str, Any]:
        """The fields as a header or commit holds them (`identity` and `kubetrain` only when known)."""
        doc: dict[str, Any] = {"step": self.step, "spec_hash": self.spec_hash}
        if self.identity is not None:
            doc["identity"] = self.identity
        if self.release:
            doc["kubetrain"] = self.release
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "Written":
        """The record of a header or commit read back (untrusted); ValueError when a field has the wrong type."""
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        step, written_hash = doc.get("step"), doc.get("spec_hash")
        ident, release = doc.get("identity"), doc.get("kubetrain", "")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not a step")
        if not isinstance(written_hash, str) or not isinstance(release, str):
            raise ValueError("spec_hash and kubetrain must be strings")
        if ident is not None and not isinstance(ident, dict):
            raise ValueError("identity must be a JSON object")
        return cls(step, written_hash, ident, release)

    @classmethod
    def of(cls, step: int, job: JobIdentity) -> "Written":
        """What this release writes for `job` at `step`."""
        return cls(step, job.spec_hash, dict(job.document) if job.document is not None else None, __version__)

    def judge(self, job: JobIdentity, written_with: Any = None) -> Verdict:
        """Whether `job` may resume this checkpoint; why not, naming the fields (`written_with`: the spec of the
        manifest found beside the checkpoints, for a hash-only one)."""
        try:
            return job.judge(self.spec_hash, self.identity, written_with)
        except (RecursionError, TypeError, ValueError, AttributeError) as err:  # an identity nested past reason
            return Verdict(False, f"its identity cannot be compared ({type(err).__name__})")


class Records:
    """What a commit (a volume's COMMIT, a bucket's commit object) says through its `written` record."""

    written: Written

    @property
    def step(self) -> int:
        return self.written.step

    @property
    def spec_hash(self) -> str:
        return self.written.spec_hash


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    bytes: int
    uri: str = ""
    """Where the checkpoint lies in object storage (spec.checkpoint.storage.uri); empty on a volume."""


class CorruptCheckpoint(Exception):
    """A checkpoint file that fails its format, length or checksum."""


class SnapshotBuffers:
    """Host copies of a state's tensors, made in the caller and reused from one save to the next.

    A fresh copy of a 200 MB state costs its page faults as much as its bytes
    (0.12 s on 2 cores, against 0.03 s into buffers already touched): the
    training loop waits for that copy, so the buffers of the last save are
    refilled. That is safe because `save` waits for the write in flight (the
    only reader of the buffers) before refilling them. The price: one copy of
    the state stays in host memory for the life of the store. A tensor whose
    shape, dtype or place in the state changed gets a new buffer; buffers of
    entries gone from the state are released. CUDA tensors are copied into
    pinned buffers without blocking and waited for once at the end.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, state: Any) -> Any:
        """A deep copy of `state` that later in-place changes of the original cannot reach."""
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()
        snapshot = self._walk(state, (), used, devices)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        self._buffers = used
        return snapshot

    def _walk(self, value: Any, path: tuple[Any, ...], used: dict, devices: set) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), path, used, devices)
        if isinstance(value, dict):
            return {k: self._walk(v, (*path, k), used, devices) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, (*path, i), used, devices) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            items = [self._walk(v, (*path, i), used, devices) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple
        # The built-in loops' leaves are immutable; a script's state may hold
        # anything torch.save takes, and none of it may change under the writer.
        return value if isinstance(value, IMMUTABLE) else copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...], used: dict, devices: set) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            return tensor.to("cpu", copy=True)  # rare layouts: a plain copy, no buffer kept
        cuda = tensor.device.type == "cuda"
        buffer = self._buffers.get(path)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or (buffer.is_pinned() if cuda else False) != cuda):
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        buffer.copy_(tensor, non_blocking=cuda)
        if cuda:
            devices.add(tensor.device)
        used[path] = buffer
        return buffer


class _HashingWriter:
    """The file `torch.save` streams into, counting and hashing what passes (the header needs both)."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)  # hashlib releases the GIL for large buffers: training goes on
        self.length += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _header_line(written: Written, length: int, digest: str, room: int) -> bytes:
    text = json.dumps({**written.to_json(), "length": length, "sha256": digest}).encode()
    if len(text) + 1 > room:
        raise ValueError(f"checkpoint header of {len(text)} bytes does not fit in {room}")
    return text.ljust(room - 1) + b"\n"


def header_room(written: Written) -> int:
    """The bytes the header of `written` takes, newline included: its widest form (a 20-digit length, a
    sha256), rounded up to HEADER_BYTES."""
    widest = len(_header_line(written, 10**20 - 1, "0" * 64, MAX_HEADER_BYTES).rstrip())
    if widest + 1 > MAX_HEADER_BYTES:
        raise ValueError(f"checkpoint header of {widest} bytes is longer than {MAX_HEADER_BYTES}")
    return -(-(widest + 1) // HEADER_BYTES) * HEADER_BYTES


def drop_cache(fd: int) -> None:
    """Ask the kernel to forget the file's cached pages (clean after fsync), so the next read is the device's."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # a filesystem without it: the read-back then checks the page cache only


def _verify_written(path: Path, header: bytes, length: int, digest: str) -> None:
    """Read `path` back and check its header, payload length and sha256; CorruptCheckpoint if not as written.

    The cached pages are dropped first where the kernel allows, so the bytes
    checked are the device's, and dropped again after: a checkpoint read once
    at the next start needs no room in the page cache (in a pod it counts
    towards the memory limit).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        drop_cache(fd)
        with os.fdopen(fd, "rb", closefd=False) as f:
            if f.read(len(MAGIC)) != MAGIC or f.read(len(header)) != header:
                raise CorruptCheckpoint("read back, the magic or header differs from what was written")
            sha, seen = hashlib.sha256(), 0
            while chunk := f.read(VERIFY_CHUNK_BYTES):
                sha.update(chunk)
                seen += len(chunk)
        if seen != length:
            raise CorruptCheckpoint(f"read back, the payload is {seen} bytes, {length} were written")
        if sha.hexdigest() != digest:
            raise CorruptCheckpoint("read back, the payload's sha256 differs from what was written")
        drop_cache(fd)
    finally:
        os.close(fd)


class Store:
    """What every checkpoint store of one job keeps: where, how many, for which spec, whom to tell.

    `on_persisted(info, seconds)` runs once a checkpoint is durable and
    verified (in the writer thread); `mid_save(step)` once its files are
    written, before they become a checkpoint (the `kill@save` fault).
    """

    def __init__(self, directory: str | Path, keep_last: int, identity: JobIdentity | str,
                 on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
                 mid_save: Callable[[int], None] | None = None):
        if keep_last < 1:
            raise ConfigError(f"spec.checkpoint.keepLast: must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.identity = identity if isinstance(identity, JobIdentity) else JobIdentity(identity)
        """The job's identity: written into every checkpoint, and what a checkpoint must match to be resumed (a
        bare hash: a store of no job, a benchmark's or a test's, that accepts only checkpoints of that hash)."""
        self.on_persisted = on_persisted
        self.mid_save = mid_save
        self.durable_step: int | None = None
        """Step of the newest checkpoint this process wrote and verified, or restored; None: none yet."""
        self.stall_seconds = 0.0
        """How long the last `save` held its caller (the wait for the write before, the copy into memory)."""
        self.set_aside_log: list[tuple[str, str]] = []
        """(checkpoint, reason) of each checkpoint a restore set aside (kept, renamed or recorded; never
        deleted), for the restore to report in the job's events."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None


class CheckpointStore(Store):
    """One replica's checkpoint directory; it assumes it is the directory's only writer."""

    def __init__(
        self,
        directory: str | Path,
        keep_last: int,
        identity: JobIdentity | str,
        background: bool = True,
        on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
        mid_save: Callable[[int], None] | None = None,
    ):
        """`background`: `save` returns once the state is copied into memory and the file is written by a
        writer thread; False writes it before `save` returns (no copy needed then)."""
        super().__init__(directory, keep_last, identity, on_persisted, mid_save)
        self.background = background
        self._buffers = SnapshotBuffers()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TransientError(f"checkpoint directory {self.directory}: cannot be created: {err}") from None

    def remove_leftovers(self) -> None:
        """Temporary files of writes a kill cut short (never renamed, so never a checkpoint). Called once the
        directory is known to be this job's (`load_latest`): nothing is removed before that."""
        for tmp in self.directory.glob(FILE_TMP_GLOB):
            tmp.unlink(missing_ok=True)

    def path_of(self, step: int) -> Path:
        return self.directory / file_name(step)

    @property
    def in_flight(self) -> bool:
        """A background write has started and not yet been waited for."""
        return self._thread is not None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy `state` into memory now and write it in the background (at once when background=False).

        At most one write is in flight: a save while the previous one is
        still being written waits for it (the wait counts in `stall_seconds`),
        so checkpoints are never skipped and `intervalSteps` keeps bounding
        the work a crash loses. A failed previous write is raised here as
        TransientError, before anything new is written.
        """
        started = time.perf_counter()
        self.wait()
        if not self.background:
            # Written before returning, so nothing can change it meanwhile: no copy.
            self._persist(step, state)
            self.stall_seconds = time.perf_counter() - started
            self.wait()
            return
        snapshot = self._buffers.copy(state)
        # The writer runs at the loop's priority: a nice writer (tried at 10)
        # starved on a busy node, and the next save waited for it
        # (`kubetrain bench checkpoint`: a 0.55 stall ratio, no less step overhead).
        self._thread = threading.Thread(target=self._persist, args=(step, snapshot), name=f"checkpoint-{step}")
        self._thread.start()
        self.stall_seconds = time.perf_counter() - started

    def wait(self) -> None:
        """Block until the last save is durable; raise TransientError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise TransientError(f"checkpoint in {self.directory}: could not be written: {err}") from err

    def _persist(self, step: int, snapshot: dict[str, Any]) -> None:
        """Write, fsync, read back, rename, publish, then report: in the writer thread (or the caller's)."""
        started = time.monotonic()
        try:
            path = self._write_file(step, snapshot)
            info = self._publish(step, path)
        except BaseException as err:  # the training thread sees it in wait()
            self._error = err
            return
        self.durable_step = step
        self._prune()
        if self.on_persisted is not None:
            self.on_persisted(info, time.monotonic() - started)

    def _write_file(self, step: int, snapshot: dict[str, Any]) -> Path:
        """`ckpt-<step>.pt` in this store's directory, durable and verified (atomic_write with a read-back)."""
        path = self.path_of(step)
        record = Written.of(step, self.identity)
        room = header_room(record)
        written: dict[str, Any] = {}

        def write(f: BinaryIO) -> None:
            f.write(MAGIC)
            f.write(b" " * (room - 1) + b"\n")  # the placeholder the header replaces
            out = _HashingWriter(f)
            torch.save(snapshot, out)  # type: ignore[arg-type]  # torch.save writes to any object with write()
            written.update(length=out.length, digest=out.sha256.hexdigest())
            written["header"] = _header_line(record, written["length"], written["digest"], room)
            f.flush()
            os.pwrite(f.fileno(), written["header"], len(MAGIC))

        def verify(tmp: Path) -> None:
            _verify_written(tmp, written["header"], written["length"], written["digest"])
            if self.mid_save is not None and self.fault_in_file:
                self.mid_save(step)

        atomic_write(path, write, verify)
        return path

    fault_in_file = True
    """Whether the `kill@save` fault fires once the file is written (before its rename); a store that
    uploads the file fires it in the middle of the upload instead."""

    def _publish(self, step: int, path: Path) -> CheckpointInfo:
        """Make the written file the newest checkpoint: move `latest` to it."""
        atomic_write(self.directory / LATEST, path.name.encode() + b"\n")
        return CheckpointInfo(step, path, path.stat().st_size)

    def _prune(self) -> None:
        for info in self.list()[: -self.keep_last]:
            try:
                info.path.unlink()
            except OSError as err:
                # A failed deletion must not fail the checkpoint that was just
                # written; the next save tries again.
                log.warning("checkpoint %s: could not be deleted: %s", info.path, err)

    def list(self) -> list[CheckpointInfo]:
        """Checkpoint files on disk, oldest first (not verified).

        Only regular files count: a symlink (it could point anywhere on the
        node) or a FIFO (reading it would hang the start) named like a
        checkpoint is skipped with a warning.
        """
        found = []
        for path in self.directory.iterdir():
            match = FILE_PATTERN.fullmatch(path.name)
            if not match:
                continue
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode):
                log.warning("checkpoint %s is not a regular file (a link, FIFO or directory); skipped", path)
                continue
            found.append(CheckpointInfo(int(match.group(1)), path, info.st_size))
        return sorted(found, key=lambda info: info.step)

    def latest_step(self) -> int | None:
        """Step of the last checkpoint known durable (the `latest` pointer), or None."""
        try:
            name = read_latest(self.directory)
        except OSError as err:  # a link or FIFO in its place: the files themselves still count
            log.warning("checkpoint pointer %s is unusable: %s", self.directory / LATEST, err.strerror or err)
            return None
        match = FILE_PATTERN.fullmatch(name) if name is not None else None
        return int(match.group(1)) if match else None

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint, or None when there is none.

        Files are verified, newest first; the `latest` pointer is not trusted
        over them. A corrupt one is renamed to `*.corrupt` with a warning and
        the previous one tried. A valid one written for another spec hash is
        refused with ConfigError: resuming it would mix two different jobs.
        """
        self.wait()
        for info in reversed(self.list()):
            try:
                written, state = self._read(info.path)
            except CorruptCheckpoint as err:
                self.set_aside(info.path, str(err))
                continue
            verdict = written.judge(self.identity)
            if not verdict.ok:
                raise another_spec(info.path, verdict, f"Delete {self.directory} or use a new run directory")
            self.remove_leftovers()
            self.durable_step = written.step
            return written.step, state
        self.remove_leftovers()
        return None

    def set_aside(self, path: Path, reason: str) -> None:
        """A checkpoint that failed its checks: renamed `*.corrupt` (kept, for a person to look at; never
        deleted), with a warning, and noted for the restore's report."""
        log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, reason)
        self.set_aside_log.append((str(path), reason))
        try:
            path.rename(path.with_name(path.name + CORRUPT_SUFFIX))
        except OSError:
            pass  # a read-only volume: it is skipped again next time, which is harmless

    @staticmethod
    def _read(path: Path) -> tuple[Written, dict[str, Any]]:
        try:
            data = read_regular(path)
        except OSError as err:
            raise CorruptCheckpoint(unreadable(err)) from None
        if not data.startswith(MAGIC):
            raise CorruptCheckpoint("not a kubetrain checkpoint (bad magic)")
        end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
        if end < 0:
            raise CorruptCheckpoint(f"no header line within {MAX_HEADER_BYTES} bytes (truncated, or not ours)")
        try:
            header = json.loads(data[len(MAGIC) : end])
            written = Written.from_json(header)
            length, digest = header["length"], header["sha256"]
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise CorruptCheckpoint(f"unreadable header: {type(err).__name__}: {str(err)[:200]}") from None
        named = FILE_PATTERN.fullmatch(path.name)
        if named and int(named.group(1)) != written.step:
            raise CorruptCheckpoint(f"its header says step {written.step}, its name step {int(named.group(1))}")
        payload = memoryview(data)[end + 1 :]
        if len(payload) != length:
            raise CorruptCheckpoint(f"payload is {len(payload)} bytes, header says {length} (truncated?)")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CorruptCheckpoint("sha256 mismatch")
        # weights_only: a checkpoint volume must not be able to run code in the trainer.
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as err:  # a payload that hashes right but does not load is no checkpoint either
            raise CorruptCheckpoint(f"payload does not load: {type(err).__name__}: {str(err)[:200]}") from None
        return written, state


def read_valid(
    directory: str | Path, on_skip: Callable[[Path, str], None] | None = None
) -> Iterator[tuple[CheckpointInfo, dict[str, Any]]]:
    """Each checkpoint of `directory` that verifies and loads, newest first, with its state; reads only.

    For tools that read a directory they do not own (`kubetrain checkpoints
    export`, a copy off a PVC): unlike `load_latest` it does not check the
    spec hash, and it leaves a corrupt file where it is (the copy may be
    read-only, and the trainer sets files aside itself) and reports it to
    `on_skip(path, reason)` (default: a warning) before trying the previous one.
    Lazy: a caller that stops at the first state reads one file.
    """
    files = sorted((p for p in Path(directory).iterdir() if FILE_PATTERN.fullmatch(p.name)), reverse=True)
    for path in files:
        try:
            written, state = CheckpointStore._read(path)
        except CorruptCheckpoint as err:
            reason = f"corrupt: {err}"
        except Exception as err:  # noqa: BLE001 - whatever torch.load raises, the file does not load
            reason = f"does not load: {type(err).__name__}: {err}"
        else:
            yield CheckpointInfo(written.step, path, path.stat().st_size), state
            continue
        if on_skip is None:
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, reason)
        else:
            on_skip(path, reason)
