"""`kubetrain bench compression`: bytes per step both ways, and accuracy, for every compression algorithm.

Runs one parameter-server manifest (the quickstart by default) through the
local backend once per algorithm, with only spec.parameterServer.compression
changed, and prints per algorithm the push and pull bytes per worker step,
the job's total bytes, its ratio to None, and the accuracy against None's.
Bytes are what the replicas counted as sent (results/<replica>.json): whole
gRPC messages (headers, pieces and payloads), not payloads alone.
"""

from __future__ import annotations

import copy
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kubetrain.api import from_object
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir

ALGORITHMS = ("None", "FP16", "Int8", "TopK", "PowerSGD")


def variant(doc: dict[str, Any], algorithm: str, ratio: float, rank: int, min_tensor_bytes: int) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    spec = out["spec"]
    if spec.get("mode") != "ParameterServer":
        raise ValueError(f"spec.mode: bench compression needs a ParameterServer manifest, got {spec.get('mode')!r}")
    out["metadata"] = {"name": f"bench-{algorithm.lower()}"}
    spec["parameterServer"] = {**spec.get("parameterServer", {}), "compression": {
        "algorithm": algorithm, "ratio": ratio, "rank": rank, "minTensorBytes": min_tensor_bytes}}
    spec["metrics"] = {"port": 0}
    return out


def figures(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Push and pull bytes per worker step from the replicas' own counts."""
    workers = [r for name, r in results.items() if name.startswith("worker-")]
    shards = [r for name, r in results.items() if name.startswith("ps-")]
    steps = sum(w.get("steps", 0) for w in workers)
    push = sum(w.get("bytes_sent", 0) for w in workers)
    pull = sum(s.get("bytes_sent", 0) for s in shards)
    return {
        "eval_accuracy": summary.get("eval_accuracy"),
        "worker_steps": steps,
        "push_bytes_per_step": round(push / steps) if steps else None,
        "pull_bytes_per_step": round(pull / steps) if steps else None,
        "total_bytes": push + pull,
        "whole_pulls": sum(s.get("whole_pulls", 0) for s in shards),
        "compressed_pulls": sum(s.get("compressed_pulls", 0) for s in shards),
        "sparse_pull_tensors": sum(s.get("sparse_pull_tensors", 0) for s in shards),
    }


def bench_compression(manifest: str, algorithms: list[str], ratio: float, rank: int,
                      min_tensor_bytes: int) -> dict[str, Any]:
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"--algorithms: unknown {', '.join(unknown)}; expected some of {', '.join(ALGORITHMS)}")
    doc = yaml.safe_load(Path(manifest).read_text())
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-compression-") as tmp:
        for algorithm in algorithms:
            job = from_object(variant(doc, algorithm, ratio, rank, min_tensor_bytes))
            run = RunDir(Path(tmp) / algorithm)
            started = time.monotonic()
            code = LocalRunner(job, run, out=io.StringIO(), echo_logs=False).run_job()
            if code != 0:
                raise RuntimeError(f"{algorithm}: the job failed (exit {code}); see {run.path}/logs")
            rows[algorithm] = {**figures(run.results(), run.read_summary() or {}),
                               "wall_seconds": round(time.monotonic() - started, 1)}
    none = rows.get("None")
    for row in rows.values():
        row["total_ratio_to_none"] = round(none["total_bytes"] / row["total_bytes"], 2) if none else None
        if none and row["eval_accuracy"] is not None and none["eval_accuracy"] is not None:
            row["accuracy_points_to_none"] = round(100 * (row["eval_accuracy"] - none["eval_accuracy"]), 2)
    return {
        "benchmark": "compression",
        "manifest": manifest,
        "compression": {"ratio": ratio, "rank": rank, "minTensorBytes": min_tensor_bytes},
        "note": "bytes are whole messages as their senders counted them; per step = per worker step "
                "(one push and one pull); pulls carry the change since the worker's copy (docs/parameter-server.md)",
        "algorithms": rows,
    }
