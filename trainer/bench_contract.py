"""`kubetrain bench contract`, its `save` half: how long kubetrain.save blocks, in one run.

(The `report` half runs a DDP script through the local backend: it is in
`kubetrain_operator.benchcli`, which needs no torch.) `save` measures how long `kubetrain.save` blocks for a state of N MiB
  when it returns durable (`wait=True`: serialise, sha256, write, fsync,
  read back, rename, the `latest` pointer) and as a script calls it (the
  copy into memory; the write before it waited for outside the timing)
  beside a raw `torch.save` to a file, and `torch.save` plus fsync, each the
  median of a few rounds. `kubetrain bench checkpoint` measures the
  background saves inside a training loop.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

def _median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_save(mib: int, rounds: int) -> dict[str, Any]:
    from . import userapi

    state = {"weights": torch.randn(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0)), "step": 1}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-save-") as tmp:
        root = Path(tmp)
        job = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bench-save"},
               "spec": {"mode": "Single", "script": {"command": ["python", "x.py"]}, "checkpoint": {"keepLast": 2},
                        "metrics": {"port": 0}}}
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
