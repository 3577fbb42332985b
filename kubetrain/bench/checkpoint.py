"""`kubetrain bench checkpoint`: what a checkpoint costs the training loop, synchronous against background, in one run.

A model of at least 100 MB (a stack of square linear layers) trains with SGD
and momentum, so the checkpointed state is its parameters plus the momentum,
as the built-in loops save them (`model`, `optimizer`, `rng`, cursor-like
numbers). Measured in one process, on one disk:

- `sync_write_seconds`: a synchronous save (`CheckpointStore(background=False)`):
  serialise, sha256, write, fsync, read back and verify, rename, `latest`.
- `restore_seconds`: a restart's restore of that checkpoint (`load_latest` of a
  new store: read, sha256, the header's identity judged, `torch.load`).
- `stall_seconds`: how long the loop waits in a background save (the copy
  into memory, plus any wait for the previous write), per checkpoint, during
  training with a checkpoint every `every` steps; `ratio_stall_to_sync` is
  the figure (aim: at most 0.10).
- `step_overhead`: the loop's seconds per step with those checkpoints
  against none, rounds alternated (ABAB) so that a slow spell of a shared
  machine hits both; the writer thread competes with training for the cores.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kubetrain.api.identity import JobIdentity
from kubetrain.trainer.checkpoint import CheckpointStore, capture_rng_state
from kubetrain.trainer.device import make_deterministic

# Square layers of this width: 2048x2048 floats are 16 MiB a layer, so a
# 100 MB model is 6 of them; wider layers would make a step slow on 2 cores.
WIDTH = 2048
BATCH = 16


def build(model_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layer_bytes = WIDTH * WIDTH * 4
    layers = max(1, -(-model_mb * 10**6 // layer_bytes))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return model, optimizer


class Loop:
    """The training loop under measure: the model, its optimizer, one fixed batch, and the step count."""

    def __init__(self, model_mb: int):
        self.model, self.optimizer = build(model_mb)
        self.x, self.target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        self.step = 0

    def train_one(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(self.x), self.target).backward()
        self.optimizer.step()
        self.step += 1

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": capture_rng_state(), "samples": self.step * BATCH, "loss": 0.0}


def _sync_saves(loop: Loop, root: Path, rounds: int) -> tuple[list[float], list[float], int]:
    """Seconds of each synchronous save and of a restore after it (a new store's `load_latest`: read, sha256,
    header judged, torch.load), and the checkpoint file's bytes."""
    store = CheckpointStore(root, keep_last=2, identity=JobIdentity("bench"), background=False)
    times, restores = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        store.save(loop.step, loop.state())
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        CheckpointStore(root, keep_last=2, identity=JobIdentity("bench")).load_latest()
        restores.append(time.perf_counter() - started)
    return times, restores, store.list()[-1].bytes


def _background_saves(loop: Loop, root: Path, steps: int, every: int, rounds: int) -> dict[str, Any]:
    """Rounds of `steps` steps without checkpoints and with one every `every` steps, alternated (ABAB):
    the loop's seconds per step of each ("loop"), and the stalls, waits and final waits of its saves."""
    store = CheckpointStore(root, keep_last=2, identity=JobIdentity("bench"), background=True)
    out: dict[str, Any] = {"stalls": [], "waits": [], "final_waits": [], "loop": {"none": [], "checkpoints": []}}
    for _ in range(rounds):
        for variant in ("none", "checkpoints"):
            started = time.perf_counter()
            for i in range(1, steps + 1):
                loop.train_one()
                if variant == "checkpoints" and i % every == 0:
                    before = time.perf_counter()
                    store.wait()  # what save() would wait for first, timed apart
                    waited = time.perf_counter()
                    store.save(loop.step, loop.state())
                    out["stalls"].append(time.perf_counter() - before)
                    out["waits"].append(waited - before)
            out["loop"][variant].append((time.perf_counter() - started) / steps)
            before = time.perf_counter()
            store.wait()  # outside the timed loop: the end of a run waits once
            if variant == "checkpoints":
                out["final_waits"].append(time.perf_counter() - before)
    return out


def bench_checkpoint(model_mb: int, steps: int, every: int, rounds: int, directory: str | None = None) -> dict[str, Any]:
    if model_mb < 100 or steps < 1 or every < 1 or rounds < 1:
        raise ValueError("--model-mb must be at least 100, --steps, --every and --rounds at least 1")
    if directory is not None and not Path(directory).is_dir():
        raise ValueError(f"--dir {directory}: not a directory")
    threads = make_deterministic()
    loop = Loop(model_mb)
    for _ in range(3):  # momentum buffers exist after the first step: the state is whole from here on
        loop.train_one()
    parameter_bytes = sum(p.numel() * p.element_size() for p in loop.model.parameters())
    state_bytes = parameter_bytes + sum(
        v.numel() * v.element_size() for s in loop.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-ckpt-", dir=directory) as tmp:
        sync_times, restore_times, file_bytes = _sync_saves(loop, Path(tmp) / "sync", rounds)
        background = _background_saves(loop, Path(tmp) / "async", steps, every, rounds)
    stalls = background["stalls"]
    sync = statistics.median(sync_times)
    steady = stalls[1:] or stalls  # the first background save also allocates its buffers
    stall = statistics.median(steady)
    per_step = {k: statistics.median(v) for k, v in background["loop"].items()}
    return {
        "benchmark": "checkpoint",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": threads,
        "model": f"{len(loop.model)} x Linear({WIDTH}, {WIDTH}), SGD momentum 0.9, batch {BATCH}",  # type: ignore[arg-type]  # an nn.Sequential
        "parameter_bytes": parameter_bytes,
        "state_bytes": state_bytes,
        "file_bytes": file_bytes,
        "rounds": rounds,
        "steps_per_round": steps,
        "every": every,
        "sync_write_seconds": round(sync, 4),
        "sync_write_seconds_all": [round(t, 4) for t in sync_times],
        "restore_seconds": round(statistics.median(restore_times), 4),
        "ratio_restore_to_sync": round(statistics.median(restore_times) / sync, 4),
        "stall_seconds": round(stall, 4),
        "stall_seconds_max": round(max(steady), 4),
        "stall_seconds_first": round(stalls[0], 4),
        "stall_wait_seconds_max": round(max(background["waits"]), 4),
        "checkpoints_in_background": len(stalls),
        "final_wait_seconds": round(statistics.median(background["final_waits"]), 4),
        "ratio_stall_to_sync": round(stall / sync, 4),
        "step_seconds": {k: round(v, 4) for k, v in per_step.items()},
        "step_overhead": round(per_step["checkpoints"] / per_step["none"] - 1, 4),
        "aim": "ratio_stall_to_sync <= 0.10",
        "note": "stall: what the loop waits in save() (copy into memory, and any wait for the previous write, "
                "stall_wait_seconds_max the longest of those waits); "
                "step_overhead: seconds per step with a checkpoint every `every` steps against none, stalls included",
    }
