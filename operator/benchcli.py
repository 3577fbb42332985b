"""`kubetrain bench`: benchmarks that print JSON with ratios measured in one run.

`modes` runs the same model on the same data for the same number of epochs
(hence samples) as Single, PS Sync, PS Async and DDP through the local
backend, one after the other, and compares their training throughput.
`transport` measures the parameter-server transport against a raw loopback
socket, and over mutual TLS against plaintext, `contract` what
kubetrain.report and kubetrain.save cost a user's script (both in the
trainer package: they need torch).
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .api import from_object
from .core.tls import job_certificates
from .local.backend import LocalBackend, save_certificates
from .local.rundir import RunDir

UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]i?B|B)?\s*", text)
    if not m or int(m[1]) <= 0:
        raise ValueError(f"--bytes {text!r}: expected a size such as 64MiB")
    return int(m[1]) * UNITS[m[2] or ""]


def mode_variants(epochs: int, hidden: int, batch: int) -> dict[str, dict[str, Any]]:
    """One manifest per mode: the same model, data, epochs and global batch (ranks share it)."""

    def doc(name: str, mode: str, per_replica_batch: int, **extra: Any) -> dict[str, Any]:
        return {
            "apiVersion": "kubetrain.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "mode": mode,
                "model": {"name": "mlp", "args": {"hidden": hidden}},
                "dataset": {"name": "digits"},
                "training": {"epochs": epochs, "batchSize": per_replica_batch, "seed": 0},
                "checkpoint": {"intervalSteps": 100000},
                "metrics": {"port": 0},
                **extra,
            },
        }

    half = max(1, batch // 2)
    return {
        "Single": doc("bench-single", "Single", batch),
        "PS-Sync": doc("bench-ps-sync", "ParameterServer", half, parameterServer={"workers": 2, "aggregation": "Sync"}),
        "PS-Async": doc("bench-ps-async", "ParameterServer", half, parameterServer={"workers": 2, "aggregation": "Async"}),
        "DDP": doc("bench-ddp", "DDP", half, ddp={"nodes": 2, "procsPerNode": 1, "backend": "gloo"}),
    }


def bench_modes(epochs: int, hidden: int, batch: int, modes: list[str] | None = None) -> dict[str, Any]:
    variants = mode_variants(epochs, hidden, batch)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-") as tmp:
        for label, doc in variants.items():
            if modes and label not in modes:
                continue
            job = from_object(doc)
            started = time.monotonic()
            code = LocalBackend(job, RunDir(Path(tmp) / label), out=io.StringIO(), echo_logs=False).run_job()
            summary = RunDir(Path(tmp) / label).read_summary() or {}
            results[label] = {
                "exit_code": code,
                "samples_per_second": summary.get("samples_per_second"),
                "eval_accuracy": summary.get("eval_accuracy"),
                "steps": summary.get("steps"),
                "bytes_sent": summary.get("bytes_sent"),
                "wall_seconds": round(time.monotonic() - started, 2),
            }
    base = (results.get("Single") or {}).get("samples_per_second")
    sync = (results.get("PS-Sync") or {}).get("samples_per_second")
    for r in results.values():
        sps = r["samples_per_second"]
        r["ratio_to_single"] = round(sps / base, 3) if sps and base else None
        r["ratio_to_ps_sync"] = round(sps / sync, 3) if sps and sync else None
    return {
        "benchmark": "modes",
        "model": f"mlp hidden={hidden}",
        "data": "digits",
        "epochs": epochs,
        "global_batch": batch,
        "note": "samples_per_second sums the replicas' training-loop throughput; ratios are to Single and PS-Sync measured in this run",
        "modes": results,
    }


# The script `bench contract` times (trainer/bench_script.py): a plain DDP loop.
SCRIPT_MODULE = "kubetrain_trainer.bench_script"


def _job(name: str, steps: int, report: bool) -> dict[str, Any]:
    args = ["--steps", str(steps)] + ([] if report else ["--no-report"])
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"mode": "DDP", "ddp": {"nodes": 2, "procsPerNode": 1},
                     "script": {"command": ["python", "-m", SCRIPT_MODULE], "args": args}}}


def bench_report(rounds: int, steps: int) -> dict[str, Any]:
    """Samples/s of one DDP script (2 ranks, gloo, loopback) with kubetrain.report every step and without.

    Alternating rounds (ABAB...), so that a slow spell of a shared machine
    hits both variants; the ratio of the medians is the figure.
    """
    measured: dict[str, list[float]] = {"with_report": [], "without_report": []}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-contract-") as tmp:
        for i in range(rounds):
            for label, report in (("with_report", True), ("without_report", False)):
                run = RunDir(Path(tmp) / f"{label}-{i}")
                job = from_object(_job(f"bench-{label.replace('_', '-')}-{i}", steps, report))
                code = LocalBackend(job, run, out=io.StringIO(), echo_logs=False, code_dir=Path(tmp)).run_job()
                summary = run.read_summary() or {}
                rate = (summary.get("metrics") or {}).get("loop_samples_per_second")
                if code != 0 or rate is None:
                    raise RuntimeError(f"{label} round {i}: the script failed (exit {code}); see {run.path}/logs")
                measured[label].append(rate)
    med = {k: statistics.median(v) for k, v in measured.items()}
    return {
        "script": f"python -m {SCRIPT_MODULE}: DDP 2 ranks x 1, gloo, MLP 64-256-10, batch 64 per rank, {steps} timed steps",
        "rounds": rounds,
        "samples_per_second": {k: [round(x) for x in v] for k, v in measured.items()},
        "median_with_report": round(med["with_report"]),
        "median_without_report": round(med["without_report"]),
        "ratio_with_to_without": round(med["with_report"] / med["without_report"], 4),
        "aim": "ratio >= 0.98",
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.bench == "transport":
        try:
            from kubetrain_trainer.ps.bench import bench_transport
        except ImportError as err:
            raise SystemExit(f"kubetrain bench transport needs the trainer's dependencies (torch, grpcio): {err}")
        # The same transport over mutual TLS in the same rounds (tls_push_ratio, tls_pull_ratio), with
        # certificates made as for a job; the shards of kubetrain's own jobs always speak it.
        with tempfile.TemporaryDirectory(prefix="kubetrain-bench-tls-") as tmp:
            files = job_certificates("bench", "default", [], datetime.now(timezone.utc))
            return bench_transport(parse_bytes(args.bytes), tls_dir=save_certificates(Path(tmp) / "tls", files))
    if args.bench == "contract":
        try:
            from kubetrain_trainer.bench_contract import bench_save
        except ImportError as err:
            raise SystemExit(f"kubetrain bench contract needs the trainer's dependencies (torch): {err}")
        if args.rounds < 1 or args.steps < 1 or args.save_mib < 1:
            raise ValueError("--rounds, --steps and --save-mib must be at least 1")
        return {"benchmark": "contract", "report": bench_report(args.rounds, args.steps),
                "save": bench_save(args.save_mib, args.rounds)}
    modes = [m for m in args.modes.split(",") if m] if args.modes else None
    return bench_modes(args.epochs, args.model_hidden, args.batch, modes)
