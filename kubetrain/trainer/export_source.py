"""Where an export reads from (`export.py`, `hf_export.py`): the run's checkpoints located (`locate`), the job's
kind, the newest usable checkpoint of each replica read once, verified (`Reader`, `newest`), and a
ParameterServer job's shards merged into the model's parameters (`read_weights`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kubetrain.shared.checkpoints import (FILE_PATTERN, LATEST, RUN_CHECKPOINTS, RUN_JOB_FILE, SHARDED_PATTERN,
                                          replica_dirs)
from kubetrain.api import InvalidSpec, TrainingJob, load_one

from . import sharded
from .checkpoint import CheckpointInfo, read_valid

EXIT_OK, EXIT_USAGE, EXIT_NO_DATA = 0, 2, 3
MODEL, PS, SCRIPT = "model", "ParameterServer", "script"
# What the built-in loops save (single.py / ddp/runtime.py, ps/server.py `state()`).
MODEL_KEYS = frozenset({"model", "optimizer", "cursor", "rng"})
SHARD_KEYS = frozenset({"params", "optimizer", "workers"})
SHARD_NAME = re.compile(r"ps-([0-9]+)")


class ExportError(Exception):
    """Input that cannot be exported; the message names the path, `exit_code` says usage (2) or no data (3)."""

    def __init__(self, message: str, exit_code: int = EXIT_NO_DATA):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Source:
    """The checkpoint directories to read and the job they belong to (None when unknown)."""

    replicas: dict[str, Path]  # replica name (directory name) -> its checkpoint directory
    job: TrainingJob | None = None
    job_file: Path | None = None
    explicit: bool = False  # several SOURCE arguments, one replica directory each


@dataclass
class Exported:
    """What `export` wrote: the kind, the step, and the files it came from."""

    kind: str
    mode: str | None
    step: int
    tensors: int
    tensor_bytes: int
    out: Path | str
    file_bytes: int
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _has_checkpoints(path: Path) -> bool:
    try:
        return any(FILE_PATTERN.fullmatch(p.name) or SHARDED_PATTERN.fullmatch(p.name) or p.name == LATEST
                   for p in path.iterdir())
    except OSError as err:
        raise ExportError(f"{path}: cannot be read ({err.strerror})", EXIT_USAGE) from None


def _load_job(job_file: Path) -> TrainingJob:
    if not job_file.is_file():
        raise ExportError(f"{job_file}: no such file (--job names the job's manifest)", EXIT_USAGE)
    try:
        return load_one(job_file)
    except InvalidSpec as err:
        raise ExportError(f"{job_file}: not a valid TrainingJob: {'; '.join(map(str, err.problems))}",
                          EXIT_USAGE) from None
    except OSError as err:
        raise ExportError(f"{job_file}: cannot be read: {err.strerror}", EXIT_USAGE) from None


def locate(sources: Sequence[str | Path], job_file: str | Path | None = None) -> Source:
    """Resolve SOURCE arguments to replica checkpoint directories; ExportError when there are none."""
    if not sources:
        raise ExportError("no SOURCE given", EXIT_USAGE)
    paths = [Path(s) for s in sources]
    for path in paths:
        if not path.exists():
            raise ExportError(f"{path}: no such directory", EXIT_USAGE)
        if not path.is_dir():
            raise ExportError(f"{path}: not a directory (expected a run directory or a checkpoint directory)",
                              EXIT_USAGE)
    default_job: Path | None = None
    if len(paths) > 1:
        replicas: dict[str, Path] = {}
        for path in paths:
            if path.resolve().name in replicas:
                raise ExportError(f"{path}: two SOURCEs named {path.resolve().name}; each SOURCE is one shard's "
                                  "directory, named after its replica (ps-0, ps-1 ...)", EXIT_USAGE)
            if not _has_checkpoints(path):
                raise ExportError(f"{path}: no checkpoints here (with several SOURCEs, each is one shard's "
                                  "directory of ckpt-<step>.pt files)")
            replicas[path.resolve().name] = path
    else:
        [path] = paths
        if (in_run := replica_dirs(path)) is not None:  # a run directory
            replicas = in_run
            default_job = path / RUN_JOB_FILE
        elif _has_checkpoints(path):  # one replica's directory: runs/<name>/checkpoints/<replica> or a copy
            replicas = {path.resolve().name: path}
            if path.resolve().parent.name == RUN_CHECKPOINTS:
                default_job = path.resolve().parent.parent / RUN_JOB_FILE
        else:  # a directory of replica directories: runs/<name>/checkpoints, or copied shards
            replicas = {p.name: p for p in sorted(path.iterdir()) if p.is_dir()}
            if path.resolve().name == RUN_CHECKPOINTS:
                default_job = path.resolve().parent / RUN_JOB_FILE
        replicas = {name: p for name, p in replicas.items() if _has_checkpoints(p)}
        if not replicas:
            raise ExportError(f"{path}: no checkpoints here (expected ckpt-<step>.pt files, replica directories "
                              "such as ps-0/ holding them, or a run directory with checkpoints/<replica>/)")
    if job_file is None and default_job is not None and default_job.is_file():
        job_file = default_job
    job = _load_job(Path(job_file)) if job_file is not None else None
    return Source(replicas, job, Path(job_file) if job_file is not None else None, explicit=len(paths) > 1)


def kind_of_job(job: TrainingJob) -> str:
    if getattr(job.spec, "script", None) is not None:
        return SCRIPT
    return PS if job.spec.mode == "ParameterServer" else MODEL


def kind_of_state(state: Any) -> str:
    if isinstance(state, dict) and SHARD_KEYS <= state.keys():
        return PS
    if isinstance(state, dict) and MODEL_KEYS <= state.keys():
        return MODEL
    return SCRIPT


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) state."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


class Reader:
    """Newest-first valid checkpoints of each replica, read lazily, skipped files remembered."""

    def __init__(self, source: Source, on_skip: Callable[[Path, str], None]):
        self.source = source
        self.skipped: dict[str, list[str]] = {}
        self._on_skip = on_skip
        self._read: dict[str, list[tuple[CheckpointInfo, dict[str, Any]]]] = {}
        self._files: dict[str, Iterator[tuple[CheckpointInfo, dict[str, Any]]]] = {}

    def stream(self, replica: str) -> Iterator[tuple[CheckpointInfo, dict[str, Any]]]:
        """(info, state), newest first; a file is read (and a corrupt one reported) once however often asked."""
        def skip(path: Path, reason: str) -> None:
            self.skipped.setdefault(replica, []).append(f"{path}: {reason}")
            self._on_skip(path, reason)

        done = self._read.setdefault(replica, [])
        if replica not in self._files:
            self._files[replica] = read_valid(self.source.replicas[replica], skip)
        i = 0
        while True:
            if i == len(done):
                found = next(self._files[replica], None)
                if found is None:
                    return
                done.append(found)
            yield done[i]
            i += 1

    def newest_sharded(self, replica: str) -> CheckpointInfo | None:
        """The newest sharded checkpoint of `replica` whose COMMIT and every file verify (not loaded)."""
        for step, path in reversed(sharded.complete(self.source.replicas[replica])):
            try:
                commit = sharded.check(path)
            except sharded.CorruptSharded as err:
                self.skipped.setdefault(replica, []).append(f"{path}: corrupt: {err}")
                self._on_skip(path, f"corrupt: {err}")
                continue
            return CheckpointInfo(step, path, sum(n for n, _ in commit.files.values()))
        return None

    def nothing_usable(self, replicas: list[str]) -> ExportError:
        where = ", ".join(str(self.source.replicas[r]) for r in replicas)
        detail = "; ".join(s for r in replicas for s in self.skipped.get(r, []))
        if not detail:  # a `latest` pointer, or files the trainer set aside as *.corrupt, and nothing else
            return ExportError(f"{where}: no checkpoint files (ckpt-<step>.pt) or sharded checkpoints here")
        return ExportError(f"{where}: no usable checkpoint, every one is corrupt ({detail})")


def _newest_single(reader: Reader, replicas: list[str]) -> tuple[str, CheckpointInfo, dict[str, Any]]:
    """The newest valid checkpoint over `replicas` (a DDP job's nodes: only rank 0 writes, but copies may differ),
    plain or sharded; a sharded one is gathered whole here (the point of an export)."""
    replica, info, state = newest(reader, replicas)
    if state is not None:
        return replica, info, state
    try:
        return replica, info, sharded.load_whole(info.path)
    except Exception as err:  # noqa: BLE001 - a piece that verifies against its COMMIT but does not load
        raise ExportError(f"{info.path}: {sharded.unfit(info.path, err)}") from None


def newest(reader: Reader, replicas: list[str]) -> tuple[str, CheckpointInfo, dict[str, Any] | None]:
    """The newest valid checkpoint over `replicas`: a plain one read, a sharded one verified only (state None)."""
    best: tuple[str, CheckpointInfo, dict[str, Any] | None] | None = None
    for replica in replicas:
        found = next(reader.stream(replica), None)
        if found is not None and (best is None or found[0].step > best[1].step):
            best = (replica, *found)
        whole = reader.newest_sharded(replica)
        if whole is not None and (best is None or whole.step > best[1].step):
            best = (replica, whole, None)
    if best is None:
        raise reader.nothing_usable(replicas)
    return best


def _expected_shards(source: Source, present: list[str]) -> list[str] | None:
    """The shard replicas the model is split over: ps-0..ps-(N-1) of the job, or by the names present."""
    if source.job is not None and source.job.spec.parameter_server is not None:
        return [f"ps-{i}" for i in range(source.job.spec.parameter_server.replicas)]
    indices = [int(m.group(1)) for m in map(SHARD_NAME.fullmatch, present) if m]
    if indices and len(indices) == len(present):
        return [f"ps-{i}" for i in range(max(indices) + 1)]
    return None  # renamed copies: nothing to check them against


def _missing_parameters(job: TrainingJob | None, missing: list[str]) -> str:
    """The parameter names the missing shards held, when the job's model can be built here."""
    if job is None:
        return "which parameters they held is unknown without the job's manifest (--job FILE)"
    try:
        from .models import model_and_data
        from .ps.job import shards_of

        spec = job.spec
        model, _ = model_and_data(spec)
        assert spec.parameter_server is not None
        assignment = shards_of(model, spec.parameter_server.replicas)
        names = [n for shard in missing for n in assignment[int(shard.split("-")[1])]]
    except Exception as err:  # noqa: BLE001 - naming the parameters is a courtesy; the shard is named anyway
        return f"its parameters could not be listed ({type(err).__name__}: {err})"
    return f"the model's parameters {', '.join(names)} are in no SOURCE"


def _merge_shards(reader: Reader, source: Source, shards: list[str]) -> tuple[int, dict[str, Any], list[Path]]:
    """The newest step every shard holds a valid checkpoint of, and the shards' params merged."""
    expected = _expected_shards(source, shards)
    if expected is not None:
        missing = [s for s in expected if s not in shards]
        if missing:
            have = ", ".join(shards) or "none"
            count = f"{len(expected)}" if source.job is not None else f"at least {len(expected)}"
            raise ExportError(
                f"shard {', '.join(missing)} of {count} missing (found {have} in "
                f"{', '.join(str(p) for p in dict.fromkeys(p.parent for p in source.replicas.values()))}): "
                f"{_missing_parameters(source.job, missing)}; copy every shard's checkpoint directory"
            )
        shards = expected
    streams = {s: reader.stream(s) for s in shards}
    current: dict[str, tuple[CheckpointInfo, dict[str, Any]]] = {}
    seen: dict[str, list[int]] = {s: [] for s in shards}

    def advance(shard: str) -> None:
        found = next(streams[shard], None)
        if found is None:
            if not seen[shard]:
                raise reader.nothing_usable([shard])
            steps = "; ".join(f"{s}: {', '.join(map(str, seen[s])) or 'none'}" for s in shards)
            raise ExportError(f"{', '.join(str(source.replicas[s]) for s in shards)}: no step that every shard "
                              f"holds a valid checkpoint of (valid steps {steps})")
        seen[shard].append(found[0].step)
        current[shard] = found

    for shard in shards:
        advance(shard)
    # Walk the newest-first streams down to the largest step all of them hold.
    while len({info.step for info, _ in current.values()}) > 1:
        target = min(info.step for info, _ in current.values())
        for shard in shards:
            if current[shard][0].step > target:
                advance(shard)
    step = current[shards[0]][0].step
    params: dict[str, Any] = {}
    for shard in shards:
        info, state = current[shard]
        if kind_of_state(state) != PS:
            keys = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ExportError(f"{info.path}: not a parameter-server shard's checkpoint "
                              f"(keys {keys}; a shard's has {', '.join(sorted(SHARD_KEYS))})")
        overlap = sorted(params.keys() & state["params"].keys())
        if overlap:
            raise ExportError(f"{info.path}: holds parameters another shard holds too ({', '.join(overlap)}): "
                              "these directories are not the shards of one job")
        params.update(state["params"])
    return step, params, [current[s][0].path for s in shards]


def read_weights(source: Source, reader: Reader) -> tuple[str, int, Any, list[Path], list[str]]:
    """(kind, step, what to save, the checkpoint files it came from, notes for the user)."""
    names = list(source.replicas)
    kind = kind_of_job(source.job) if source.job is not None else None
    if kind == PS:
        shards = names if source.explicit else [n for n in names if SHARD_NAME.fullmatch(n)]
        return (PS, *_merge_shards(reader, source, shards), [])
    _, info, state = _newest_single(reader, names)
    kind = kind or kind_of_state(state)
    if kind == PS:  # told by the state's keys: no manifest says how many shards there were
        note = (f"parameter-server shards {', '.join(sorted(names))} merged; without the job's manifest the number "
                "of shards is not known (pass --job FILE to check that none is missing)")
        return (PS, *_merge_shards(reader, source, names), [note])
    if source.explicit:
        raise ExportError(f"{', '.join(map(str, source.replicas.values()))}: several SOURCEs are the shards of one "
                          f"ParameterServer job, but {info.path} holds a {kind} checkpoint", EXIT_USAGE)
    if kind == SCRIPT:
        return SCRIPT, info.step, state, [info.path], []
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        keys = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ExportError(f"{info.path}: holds no model state_dict (keys {keys}); not a checkpoint of a built-in "
                          "Single or DDP job")
    weights = state["model"]
    # A model saved through its DDP wrapper: keys as the bare model has them.
    if weights and all(str(k).startswith("module.") for k in weights):
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    return MODEL, info.step, weights, [info.path], []
