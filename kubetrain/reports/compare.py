"""compare: run the variants of one manifest (modes x compression) locally, then report on them."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml

from kubetrain.api import MODES, TrainingJob, from_object, load_one, to_manifest
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir, RunDirError
from .report import build_report
from .runs import ReportError

INTERRUPTED = 130  # LocalRunner.run_job after SIGINT/SIGTERM (checkpointed, resumable)
SHORT = {"Single": "single", "ParameterServer": "ps", "DDP": "ddp"}
# What --compression means per mode: the parameter server's algorithm, DDP's communication hook.
PS_COMPRESSION = ("None", "FP16", "Int8", "TopK", "PowerSGD")
DDP_HOOKS = ("None", "FP16", "PowerSGD")


def variant(base: dict[str, Any], mode: str, compression: str | None, global_batch: int | None = None) -> dict[str, Any]:
    """The manifest `base` turned into `mode` (with `compression` where the mode has it), named for both.

    With `global_batch`, each variant's per-replica batchSize is set so that all
    its replicas together take that many samples a step, as the base job does:
    the variants then train on the same data in the same order.
    """
    doc = copy.deepcopy(base)
    spec = doc["spec"]
    spec["mode"] = mode
    name = f"{doc['metadata']['name']}-{SHORT[mode]}"
    if mode != "ParameterServer":
        spec.pop("parameterServer", None)
    if mode != "DDP":
        spec.pop("ddp", None)
    if mode == "ParameterServer":
        spec.setdefault("parameterServer", {})
        if compression is not None:
            spec["parameterServer"].setdefault("compression", {})["algorithm"] = compression
            name += f"-{compression.lower()}"
    if mode == "DDP":
        spec.setdefault("ddp", {})
        if compression is not None:
            spec["ddp"]["commHook"] = compression
            name += f"-{compression.lower()}"
    doc["metadata"]["name"] = name
    if global_batch is not None:
        world = from_object(doc, name).spec.world_size
        spec.setdefault("training", {})["batchSize"] = max(1, global_batch // world)
    return doc


def variants(job: TrainingJob, modes: list[str], compression: list[str] | None) -> list[TrainingJob]:
    """Every (mode, compression) pair that means something, validated; ValueError names a bad mode or name."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: expected a comma-separated subset of {', '.join(MODES)}, got {', '.join(modes)!r}")
    bad = [c for c in compression or [] if c not in PS_COMPRESSION]
    if bad:
        raise ValueError(f"--compression: expected names from {', '.join(PS_COMPRESSION)}, got {', '.join(bad)}")
    if job.spec.script is not None:
        raise ValueError(f"{job.name}: a script job trains its own way; compare runs variants of the built-in loop only")
    base = to_manifest(job)
    global_batch = job.spec.require_training().batch_size * job.spec.world_size
    out: list[TrainingJob] = []
    for mode in modes:
        choices: list[str | None] = [None]
        if compression and mode == "ParameterServer":
            choices = list(compression)
        elif compression and mode == "DDP":
            choices = [c for c in compression if c in DDP_HOOKS] or [None]
        for choice in choices:
            candidate = from_object(variant(base, mode, choice, global_batch), f"{job.name} as {mode}")
            if candidate.name not in [j.name for j in out]:
                out.append(candidate)
    return out


def compare(manifest: Path, modes: list[str], compression: list[str] | None, out: Path,
            stream: TextIO = sys.stderr) -> Path:
    """Run each variant of `manifest` with the local backend under `out/runs/<variant>`, then write the report.

    A variant whose run directory already holds a finished run is not run
    again, so an interrupted comparison continues where it stopped. A failed
    variant is reported (state Failed) like the others. Returns `out/report.md`.
    Raises InvalidSpec (the manifest or a variant), ValueError (modes or
    compression names) or ReportError (a run directory that holds another job).
    """
    job = load_one(manifest)
    jobs = variants(job, modes, compression)
    out = Path(out)
    (out / "manifests").mkdir(parents=True, exist_ok=True)
    run_dirs = []
    for variant_job in jobs:
        (out / "manifests" / f"{variant_job.name}.yaml").write_text(yaml.safe_dump(to_manifest(variant_job),
                                                                                    sort_keys=False))
        run_dir = out / "runs" / variant_job.name
        print(f"compare: {variant_job.name} ({variant_job.spec.mode}) in {run_dir}", file=stream)
        try:
            code = LocalRunner(variant_job, RunDir(run_dir), out=stream, echo_logs=False).run_job()
        except RunDirError as err:
            raise ReportError(str(err)) from None
        if code == INTERRUPTED:  # the user stopped it: stop the comparison too; rerunning resumes
            raise KeyboardInterrupt
        run_dirs.append(run_dir)
    return build_report(run_dirs, out)
