"""Checkpoints owned by the system: atomic, verifiable files, resumed from on every start.

A checkpoint file is `ckpt-<step:08d>.pt`: a magic line, a JSON header line
(step, spec hash, payload length and sha256), then the `torch.save` payload.
A file is written under a temporary name, fsynced and renamed, and only then
does the `latest` pointer move, so a crash at any moment leaves either the old
or the new checkpoint whole. A file that still fails its length or checksum
(a torn copy, a bad disk) is set aside and the previous one is used.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain_operator.api import Spec
from kubetrain_operator.api.schema import to_dict

from .errors import ConfigError, TransientError

log = logging.getLogger(__name__)

MAGIC = b"KUBETRAIN-CKPT-1\n"
FILE_PATTERN = re.compile(r"ckpt-([0-9]{8})\.pt")
LATEST = "latest"

# Fields of spec.training that do not change the path the parameters take:
# a run may be extended (more epochs) or moved to another device and resume.
NON_MATH_TRAINING = ("epochs", "maxSteps", "device")


def spec_hash(spec: Spec) -> str:
    """Hash of what decides the math: model, dataset, training, mode and topology."""
    doc = to_dict(spec)
    if spec.script is not None:
        # A script's state is its own: kubetrain cannot tell which changes of
        # the script break it. Only a built-in job's checkpoints are refused.
        return hashlib.sha256(json.dumps({"mode": doc["mode"], "script": True}).encode()).hexdigest()[:16]
    math_doc: dict[str, Any] = {
        "mode": doc["mode"],
        "model": doc["model"],
        "dataset": doc["dataset"],
        "training": {k: v for k, v in doc["training"].items() if k not in NON_MATH_TRAINING},
    }
    if "parameterServer" in doc:
        ps = doc["parameterServer"]
        math_doc["parameterServer"] = {
            k: ps[k] for k in ("replicas", "workers", "aggregation", "maxStaleness", "compression")
        }
    if "ddp" in doc:
        math_doc["ddp"] = {k: doc["ddp"][k] for k in ("nodes", "procsPerNode", "commHook", "powerSGDRank")}
    return hashlib.sha256(json.dumps(math_doc, sort_keys=True).encode()).hexdigest()[:16]


def capture_rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and Python RNG states, in types `torch.load(weights_only=True)` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
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


def read_regular(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file, never following a symlink or blocking on a FIFO.

    OSError (ELOOP for a link, EISDIR-like for anything not regular) for
    anything else: a checkpoint volume is writable by the job's own code.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if max_bytes is None else f.read(max_bytes)
    finally:
        os.close(fd)


def unreadable(err: OSError) -> str:
    """Why read_regular refused a file, for a person."""
    if err.errno == errno.ELOOP:
        return "a symbolic link, refused (checkpoints are read from regular files only: a link could point anywhere)"
    if err.errno == errno.EINVAL:
        return "not a regular file (a FIFO, device or directory), refused"
    return f"cannot be read: {err.strerror or err}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    bytes: int


class CorruptCheckpoint(Exception):
    """A checkpoint file that fails its format, length or checksum."""


def _snapshot(value: Any) -> Any:
    """A copy that later training steps cannot change (optimizer state is updated in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _write_atomic(path: Path, chunks: list[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    # Created afresh (O_EXCL never follows a link): a link planted under the
    # temporary name by code that shares the volume is replaced, not written through.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """One replica's checkpoint directory; it assumes it is the directory's only writer."""

    def __init__(
        self,
        directory: str | Path,
        keep_last: int,
        spec_hash: str,
        background: bool = True,
        on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
    ):
        """`on_persisted(info, seconds)` runs after each file is durable (in the writer thread)."""
        if keep_last < 1:
            raise ConfigError(f"spec.checkpoint.keepLast: must be at least 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.spec_hash = spec_hash
        self.background = background
        self.on_persisted = on_persisted
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TransientError(f"checkpoint directory {self.directory}: cannot be created: {err}") from None
        # Left behind by a process killed mid-write; never renamed, so never a checkpoint.
        for tmp in self.directory.glob(".ckpt-*.tmp"):
            tmp.unlink(missing_ok=True)

    def path_of(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:08d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state` now; write it in the background (at once when background=False).

        Waits for the previous write first, so at most one is in flight and a
        failed one is reported (as TransientError) before the next begins.
        """
        self.wait()
        if not self.background:
            # Written before returning, so nothing can change it meanwhile: no copy.
            self._persist(step, state)
            self.wait()
            return
        snapshot = _snapshot(state)
        self._thread = threading.Thread(target=self._persist, args=(step, snapshot), name=f"checkpoint-{step}")
        self._thread.start()

    def wait(self) -> None:
        """Block until the last save is durable; raise TransientError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise TransientError(f"checkpoint in {self.directory}: could not be written: {err}") from err

    def _persist(self, step: int, snapshot: dict[str, Any]) -> None:
        started = time.monotonic()
        path = self.path_of(step)
        try:
            buffer = io.BytesIO()
            torch.save(snapshot, buffer)
            payload = buffer.getvalue()
            header = {
                "step": step,
                "spec_hash": self.spec_hash,
                "length": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
            _write_atomic(path, [MAGIC, json.dumps(header).encode() + b"\n", payload])
            _write_atomic(self.directory / LATEST, [path.name.encode() + b"\n"])
        except BaseException as err:  # the training thread sees it in wait()
            self._error = err
            return
        self._prune()
        if self.on_persisted is not None:
            self.on_persisted(CheckpointInfo(step, path, path.stat().st_size), time.monotonic() - started)

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
            name = read_regular(self.directory / LATEST, 4096).decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as err:  # a link or FIFO in its place: the files themselves still count
            log.warning("checkpoint pointer %s is unusable: %s", self.directory / LATEST, err.strerror or err)
            return None
        match = FILE_PATTERN.fullmatch(name)
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
                step, written_hash, state = self._read(info.path)
            except CorruptCheckpoint as err:
                log.warning("checkpoint %s is unusable (%s); falling back to the previous one", info.path, err)
                try:
                    info.path.rename(info.path.with_name(info.path.name + ".corrupt"))
                except OSError:
                    pass  # a read-only volume: it is skipped again next time, which is harmless
                continue
            if written_hash != self.spec_hash:
                raise ConfigError(
                    f"checkpoint {info.path} was written for a different spec (hash {written_hash}, this job "
                    f"{self.spec_hash}): model, dataset, training or topology changed. Delete "
                    f"{self.directory} or use a new run directory to start over"
                )
            return step, state
        return None

    @staticmethod
    def _read(path: Path) -> tuple[int, str, dict[str, Any]]:
        try:
            data = read_regular(path)
        except OSError as err:
            raise CorruptCheckpoint(unreadable(err)) from None
        if not data.startswith(MAGIC):
            raise CorruptCheckpoint("not a kubetrain checkpoint (bad magic)")
        end = data.find(b"\n", len(MAGIC))
        if end < 0:
            raise CorruptCheckpoint("no header line (truncated?)")
        try:
            header = json.loads(data[len(MAGIC) : end])
            step, written_hash, length, digest = header["step"], header["spec_hash"], header["length"], header["sha256"]
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpoint(f"unreadable header: {err}") from None
        payload = data[end + 1 :]
        if len(payload) != length:
            raise CorruptCheckpoint(f"payload is {len(payload)} bytes, header says {length} (truncated?)")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CorruptCheckpoint("sha256 mismatch")
        # weights_only: a checkpoint volume must not be able to run code in the trainer.
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as err:  # a payload that hashes right but does not load is no checkpoint either
            raise CorruptCheckpoint(f"payload does not load: {type(err).__name__}: {str(err)[:200]}") from None
        return step, written_hash, state


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
            step, _, state = CheckpointStore._read(path)
        except CorruptCheckpoint as err:
            reason = f"corrupt: {err}"
        except Exception as err:  # noqa: BLE001 - whatever torch.load raises, the file does not load
            reason = f"does not load: {type(err).__name__}: {err}"
        else:
            yield CheckpointInfo(step, path, path.stat().st_size), state
            continue
        if on_skip is None:
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, reason)
        else:
            on_skip(path, reason)
