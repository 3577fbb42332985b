"""`kubetrain bench contract`: what kubetrain.report and kubetrain.save cost a user's script, in one run.

`report` runs a DDP script (script.py) through the local backend with
kubetrain.report every step and without. `save` measures how long `kubetrain.save` blocks for a state of N MiB
  when it returns durable (`wait=True`: serialise, sha256, write, fsync,
  read back, rename, the `latest` pointer) and as a script calls it (the
  copy into memory; the write before it waited for outside the timing)
  beside a raw `torch.save` to a file, and `torch.save` plus fsync, each the
  median of a few rounds. `kubetrain bench checkpoint` measures the
  background saves inside a training loop.
"""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from kubetrain.api import from_object
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir

from .jobs import manifest

# The script `bench contract` times (script.py): a plain DDP loop.
SCRIPT_MODULE = "kubetrain.bench.script"


def _job(name: str, steps: int, report: bool) -> dict[str, Any]:
    args = ["--steps", str(steps)] + ([] if report else ["--no-report"])
    return manifest(name, {"mode": "DDP", "ddp": {"nodes": 2, "procsPerNode": 1},
                           "script": {"command": ["python", "-m", SCRIPT_MODULE], "args": args}})


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
                code = LocalRunner(job, run, out=io.StringIO(), echo_logs=False, code_dir=Path(tmp)).run_job()
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


def _median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_save(mib: int, rounds: int) -> dict[str, Any]:
    from kubetrain.trainer import userapi

    state = {"weights": torch.randn(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0)), "step": 1}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-save-") as tmp:
        root = Path(tmp)
        job = manifest("bench-save", {"mode": "Single", "script": {"command": ["python", "x.py"]},
                                      "checkpoint": {"keepLast": 2}, "metrics": {"port": 0}})
        (root / "job.yaml").write_text(yaml.safe_dump(job))
        session = userapi.Session({"KUBETRAIN_JOB_FILE": str(root / "job.yaml"), "KUBETRAIN_REPLICA": "single-0",
                                   "KUBETRAIN_RUN_DIR": str(root), "KUBETRAIN_CHECKPOINT_DIR": str(root / "ckpt"),
                                   "KUBETRAIN_METRICS_PORT": "0"})
        raw_path = root / "raw.pt"

        def raw() -> None:
            torch.save(state, raw_path)

        def raw_fsync() -> None:
            with open(raw_path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        step = iter(range(1, 1000))
        seconds = {
            "torch_save": _median_seconds(raw, rounds),
            "torch_save_fsync": _median_seconds(raw_fsync, rounds),
            "kubetrain_save": _median_seconds(lambda: session.save(state, next(step), wait=True), rounds),
        }
        copies = []
        for _ in range(rounds):
            session.checkpoints.wait()
            copies.append(_median_seconds(lambda: session.save(state, next(step)), 1))
        seconds["kubetrain_save_background"] = statistics.median(copies)
        session.close()
    return {
        "state_mib": mib,
        "rounds": rounds,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "ratio_kubetrain_to_torch_save": round(seconds["kubetrain_save"] / seconds["torch_save"], 3),
        "ratio_kubetrain_to_torch_save_fsync": round(seconds["kubetrain_save"] / seconds["torch_save_fsync"], 3),
        "note": "kubetrain_save: durable on return (wait=True): serialise and sha256, write, fsync, read back, "
                "rename, `latest`; kubetrain_save_background: what a plain kubetrain.save blocks for (the copy "
                "into memory) when the write before it is done",
    }
