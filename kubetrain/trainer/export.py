"""Get the model out: the weights of a job's newest usable checkpoint as one plain `torch.save` file.

`kubetrain checkpoints export SOURCE... --out FILE` writes a file that
`torch.load(FILE, weights_only=True)` turns into a state_dict, with nothing
of kubetrain in it (no header, no optimizer, no cursor):

- a built-in Single or DDP job: the checkpoint's `model` entry, the
  state_dict of the model `models.build_model` builds;
- a ParameterServer job: the `params` of every shard, of one step that all
  shards hold, merged under the model's parameter names (the shards are
  keyed by `named_parameters()` names, see ps/job.py `shards_of`); shards
  hold parameters only, so a model with buffers (BatchNorm statistics)
  loads it with `strict=False`;
- a script job (`spec.script`): the state the script gave `kubetrain.save`,
  as it is.

A sharded checkpoint (`sharded-<step>/`, every rank's shards: FSDP2, tensor
parallel) is verified (COMMIT and every file) and gathered whole into the
file, its DTensors as plain tensors: the model loads into an unsharded copy.

SOURCE is a run directory (`runs/<name>`: job.yaml and checkpoints/<replica>/),
one replica's checkpoint directory (a copy off a PVC), a directory holding
replica directories (`ps-0/`, `ps-1/` ...), or several replica directories,
one per SOURCE (the shards of a ParameterServer job). The kind comes from the
job's manifest when there is one (the run directory's job.yaml or `--job`),
otherwise from the keys of the saved state.

Files are read with `checkpoint.read_valid`: verified, never modified, a
corrupt newest one is skipped for the previous one; the spec hash is not
checked (a copied directory may have no job at all). FILE is written under a
temporary name, fsynced and renamed: an existing FILE is only ever replaced
by a complete new one.

Exit codes: 0 written; 2 bad input (SOURCE missing or not a directory, OUT's
directory missing or not writable, an unreadable job file); 3 no usable data
(no checkpoint, every checkpoint corrupt, a shard missing). One line on
stderr, no traceback.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from kubetrain.shared.files import atomic_write

from .export_source import (EXIT_NO_DATA, EXIT_OK, EXIT_USAGE, PS, SCRIPT, Exported, ExportError, Reader, locate,
                            read_weights, tensors_of)

__all__ = ["EXIT_NO_DATA", "EXIT_OK", "EXIT_USAGE", "FORMATS", "Exported", "ExportError", "export", "flat_tensors",
           "locate", "main_export"]

FORMATS = ("torch", "safetensors", "huggingface")


def export(sources: Sequence[str | Path], out: str | Path, job_file: str | Path | None = None,
           on_skip: Callable[[Path, str], None] | None = None, fmt: str = "torch",
           hf_options: dict[str, Any] | None = None) -> Exported:
    """Write the weights of the newest usable checkpoint under `sources` to `out` (a file, or s3://BUCKET/KEY,
    uploaded once written whole) as `fmt`; ExportError on bad input. `fmt` huggingface: a causal-lm job's model as
    a Hugging Face directory (hf_export.py; `hf_options` its merge_lora and max_shard_bytes).

    `on_skip(path, reason)` hears of every checkpoint passed over as corrupt.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format: expected {' or '.join(FORMATS)}, got {fmt!r}", EXIT_USAGE)
    if fmt == "huggingface":
        from .hf_export import export_huggingface

        return export_huggingface(sources, out, job_file, on_skip, **(hf_options or {}))
    target = _target(out)
    source = locate(sources, job_file)
    kind, step, weights, files, notes = read_weights(source, Reader(source, on_skip or (lambda path, reason: None)))
    tensors = tensors_of(weights)
    if fmt == "safetensors":
        weights, left_out = flat_tensors(weights)
        if left_out:
            notes.append(f"safetensors holds tensors only: {len(left_out)} other value(s) left out "
                         f"({', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''})")
        if not weights:
            raise ExportError(f"{', '.join(str(p) for p in files)}: holds no tensors to write as safetensors")
    try:
        with _written(target) as path:
            file_bytes = atomic_write(path, lambda f: _write(weights, f, fmt))
    except OSError as err:
        raise ExportError(f"{out}: could not be written ({err.strerror or err})", EXIT_USAGE) from None
    return Exported(kind=kind, mode=source.job.spec.mode if source.job is not None else None, step=step,
                    tensors=len(tensors), tensor_bytes=sum(t.numel() * t.element_size() for t in tensors),
                    out=target if isinstance(target, Path) else str(target), file_bytes=file_bytes, files=files,
                    notes=notes)


def _target(out: str | Path) -> Any:
    """--out as a Path to write, or an ObjectURI to upload to; ExportError (exit 2) when it cannot be one."""
    from .errors import ConfigError
    from .objstore import is_uri, parse_uri

    if is_uri(str(out)):
        try:
            uri = parse_uri(str(out), "--out")
        except ConfigError as err:
            raise ExportError(str(err), EXIT_USAGE) from None
        if uri.is_prefix:
            raise ExportError(f"--out {out}: names a prefix; give the object's key (s3://BUCKET/KEY)", EXIT_USAGE)
        return uri
    path = Path(out)
    if not path.parent.is_dir():
        raise ExportError(f"{path.parent}: no such directory (the directory of --out {path})", EXIT_USAGE)
    if path.is_dir():
        raise ExportError(f"{path}: is a directory; --out names the file to write", EXIT_USAGE)
    return path


@contextlib.contextmanager
def _written(target: Any) -> Iterator[Path]:
    """The path to write: the target itself, or a temporary file uploaded to the target once written whole."""
    if isinstance(target, Path):
        yield target
        return
    import tempfile

    from .errors import TrainerError
    from .objstore import shared_store

    with tempfile.TemporaryDirectory(prefix="kubetrain-export-") as tmp:
        path = Path(tmp) / target.name
        yield path
        try:
            shared_store().upload(path, target)
        except TrainerError as err:
            raise ExportError(str(err)) from None


def _write(weights: Any, f: Any, fmt: str) -> None:
    if fmt == "torch":
        torch.save(weights, f)
        return
    from safetensors.torch import save

    f.write(save(weights, metadata={"format": "pt"}))


def flat_tensors(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of a (nested) state under dotted names (`model.0.weight`), each its own contiguous copy
    (safetensors refuses tensors that share memory), and the names of the values that are not tensors."""
    tensors: dict[str, torch.Tensor] = {}
    others: list[str] = []
    if isinstance(state, torch.Tensor):
        tensors[prefix or "tensor"] = state.detach().cpu().contiguous().clone()
    elif isinstance(state, dict):
        for key, value in state.items():
            found, left = flat_tensors(value, f"{prefix}.{key}" if prefix else str(key))
            tensors.update(found)
            others += left
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found, left = flat_tensors(value, f"{prefix}.{i}" if prefix else str(i))
            tensors.update(found)
            others += left
    else:
        others.append(prefix or type(state).__name__)
    return tensors, others


def main_export(sources: Sequence[str | Path], out: str | Path, job_file: str | Path | None = None,
                stdout: TextIO | None = None, stderr: TextIO | None = None, fmt: str = "torch",
                hf_options: dict[str, Any] | None = None) -> int:
    """`kubetrain checkpoints export SOURCE... --out FILE|s3://... [--format F] [--job FILE]`: 0 written, 2 bad
    input, 3 no usable data."""
    prefix = "kubetrain checkpoints export"
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr  # looked up now: tests and callers redirect sys.*

    def skipped(path: Path, reason: str) -> None:
        print(f"{prefix}: skipped {path}: {reason}", file=stderr)

    try:
        done = export(sources, out, job_file, on_skip=skipped, fmt=fmt, hf_options=hf_options)
    except ExportError as err:
        print(f"{prefix}: error: {err}", file=stderr)
        return err.exit_code
    for note in done.notes:
        print(f"{prefix}: note: {note}", file=stderr)
    if done.kind == PS:
        what = f"the model (ParameterServer, {len(done.files)} shards merged)"
    elif done.kind == SCRIPT:
        what = f"the saved state as it is (script, {done.mode})" if done.mode else "the saved state as it is (script)"
    elif fmt == "huggingface":
        what = f"the model as a Hugging Face directory ({done.mode})"
    else:
        what = f"the model ({done.mode or 'Single or DDP'})"
    print(f"exported {what} at step {done.step}: {done.tensors} tensors, {done.tensor_bytes:,} bytes "
          f"-> {done.out} ({done.file_bytes:,} bytes; from {', '.join(str(p) for p in done.files)})", file=stdout)
    return EXIT_OK
