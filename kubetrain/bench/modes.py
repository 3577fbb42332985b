"""`kubetrain bench modes`: Single, PS Sync, PS Async and DDP on the same work, compared in one run.

It runs the same model on the same data for the same samples in every mode
through the local backend, one after the other, in three cases (a small MLP,
a compute-heavier CNN, the CNN with one straggler), and compares their
throughput and their time to a target accuracy.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.shared.launch import SLOWDOWN_VAR
from kubetrain.api import from_object
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir

from .jobs import manifest

MODE_LABELS = ("Single", "PS-Sync", "PS-Async", "DDP")
CASES = ("small", "cnn", "straggler")
# The compute-heavier model (issue 17: "the CNN at a size where a step takes
# tens of milliseconds"): the built-in CNN whose step of 32 digits takes about
# 29 ms of CPU on one thread of the 2-core development machine (forward,
# backward and the optimizer; 1.65 MB of parameters), against 0.3 ms for the
# MLP. The earlier `channels: 32, hidden: 256` took 5.6 ms for 2.15 MB: its
# 256-wide dense layer held the parameters, the convolutions little compute.
CNN_ARGS = {"channels": 128, "hidden": 32}
# Checkpoints per epoch of each run: the points at which the model is
# evaluated for the time to the target accuracy (offline, after the run,
# from the checkpoint files), so a quarter of an epoch is the resolution of
# that time. Each one is a snapshot plus a background write with three
# fsyncs; more would let the writes show in the step times of the CNN.
CHECKPOINTS_PER_EPOCH = 4
# Every checkpoint must survive for the evaluation: spec.checkpoint.keepLast's
# maximum. It bounds a run to MAX_EPOCHS (CHECKPOINTS_PER_EPOCH x MAX_EPOCHS
# + 1 <= 1000); beyond, --epochs is refused rather than losing early points.
KEEP_ALL = 1000
MAX_EPOCHS = (KEEP_ALL - 1) // CHECKPOINTS_PER_EPOCH
# Data-parallel replicas of the distributed modes: 2 PS workers (+ 1 shard), 2 DDP ranks.
REPLICAS = 2


@dataclass(frozen=True)
class Variant:
    """One mode of one case: its manifest and the environment its replicas get (the straggler knob)."""

    doc: dict[str, Any]
    env: dict[str, str]


def mode_variants(case: str, epochs: int, batch: int, steps_per_epoch: int, hidden: int = 128,
                  slow_factor: float = 3.0) -> dict[str, Variant]:
    """One manifest per mode for `case`: the same model, data, samples and global batch.

    Every mode runs `epochs x steps_per_epoch` steps of the global batch
    `batch` (maxSteps; two-replica modes take half the batch per replica, and
    PS Async counts each worker's push as a step, so it runs twice as many).
    `straggler`: the CNN with worker-1 and DDP rank 1 slowed `slow_factor`
    times (kubetrain/trainer/testhooks.py); Single has no peer to wait for and runs
    unslowed. There PS Async's maxStaleness is its whole run, so the fast
    worker is never held back by the slow one (the default 4 would hold it
    within 4 steps of the straggler: Sync's pace).
    """
    if case not in CASES:
        raise ValueError(f"--case {case!r}: expected one of {', '.join(CASES)} or all")
    if not 1 <= epochs <= MAX_EPOCHS:
        raise ValueError(f"--epochs {epochs}: expected 1 to {MAX_EPOCHS} (every checkpoint is kept: keepLast "
                         f"{KEEP_ALL}, {CHECKPOINTS_PER_EPOCH} a epoch)")
    if batch < REPLICAS or batch % REPLICAS:
        raise ValueError(f"--batch {batch}: expected an even global batch of at least {REPLICAS}")
    model = {"name": "mlp", "args": {"hidden": hidden}} if case == "small" else {"name": "cnn", "args": dict(CNN_ARGS)}
    steps = epochs * steps_per_epoch
    every = max(1, steps_per_epoch // CHECKPOINTS_PER_EPOCH)

    def doc(name: str, mode: str, per_replica_batch: int, max_steps: int, interval: int, **extra: Any) -> dict[str, Any]:
        return manifest(f"bench-{case}-{name}", {
            "mode": mode,
            "model": model,
            "dataset": {"name": "digits"},
            "training": {"maxSteps": max_steps, "batchSize": per_replica_batch, "seed": 0},
            "checkpoint": {"intervalSteps": interval, "keepLast": KEEP_ALL},
            "metrics": {"port": 0},
            **extra,
        })

    half = batch // REPLICAS
    staleness = 2 * steps if case == "straggler" else 4
    env = {SLOWDOWN_VAR: f"worker-1:{slow_factor:g},ddp-1:{slow_factor:g}"} if case == "straggler" else {}
    return {
        "Single": Variant(doc("single", "Single", batch, steps, every), {}),
        "PS-Sync": Variant(doc("ps-sync", "ParameterServer", half, steps, every,
                               parameterServer={"workers": REPLICAS, "aggregation": "Sync"}), env),
        "PS-Async": Variant(doc("ps-async", "ParameterServer", half, REPLICAS * steps, REPLICAS * every,
                                parameterServer={"workers": REPLICAS, "aggregation": "Async",
                                                 "maxStaleness": staleness}), env),
        "DDP": Variant(doc("ddp", "DDP", half, steps, every,
                           ddp={"nodes": REPLICAS, "procsPerNode": 1, "backend": "gloo"}), env),
    }


def read_events(metrics_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every replica's JSONL events (metrics/<replica>.jsonl), in file order; unreadable lines skipped."""
    events: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(metrics_dir).glob("*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a killed process
        events[path.stem] = lines
    return events


@dataclass(frozen=True)
class Span:
    """The training of a run as its JSONL tells it."""

    start: float
    """First `start` event of a replica that trains (model built, group joined or registered)."""
    end: float
    """Last `train` event of any replica."""
    samples: int
    """Samples trained up to each replica's last `train` event, summed."""

    @property
    def samples_per_second(self) -> float | None:
        return self.samples / (self.end - self.start) if self.end > self.start else None


def training_span(events: dict[str, list[dict[str, Any]]]) -> Span | None:
    """Samples over the wall time of the training itself: the job's throughput, waits included.

    The summary's samples_per_second sums each replica's own loop rate, and
    a PS worker's leaves out the pull (where a Sync worker waits for the
    others), a DDP rank's does not; this figure counts every mode alike. A
    parameter-server shard trains nothing (no `train` events) and is left out.
    """
    starts, ends, samples = [], [], 0
    for lines in events.values():
        trains = [e for e in lines if e.get("event") == "train"]
        if not trains:
            continue
        starts += [e["time"] for e in lines if e.get("event") == "start"][:1]
        ends.append(trains[-1]["time"])
        samples += int(trains[-1].get("samples") or 0)
    if not starts or not ends:
        return None
    return Span(min(starts), max(ends), samples)


def checkpoint_times(events: dict[str, list[dict[str, Any]]]) -> dict[int, float]:
    """step -> when its checkpoint's snapshot was taken: the event's time less the write's seconds.

    The `checkpoint` event is written once the file is durable. A replica
    may write one step twice (the interval's, then the end's): its first
    counts. With several shards, the last shard's snapshot (the model is
    whole only then).
    """
    times: dict[int, float] = {}
    for lines in events.values():
        own: dict[int, float] = {}
        for e in lines:
            if e.get("event") == "checkpoint":
                own.setdefault(e["step"], e["time"] - float(e.get("seconds") or 0.0))
        for step, at in own.items():
            times[step] = max(times.get(step, at), at)
    return times


def time_to_accuracy(evaluations: list[dict[str, Any]], times: dict[int, float], start: float,
                     target: float) -> tuple[float, int] | None:
    """(seconds from `start`, step) of the first checkpoint whose eval accuracy reaches `target`; None if none does."""
    for ev in sorted(evaluations, key=lambda e: e["step"]):
        accuracy = ev.get("eval_accuracy")
        if accuracy is not None and accuracy >= target and ev["step"] in times:
            return round(times[ev["step"]] - start, 3), ev["step"]
    return None


@contextmanager
def _environment(values: dict[str, str], clear: tuple[str, ...]) -> Iterator[None]:
    """os.environ with `clear` removed and `values` set, restored after: the local backend's replicas inherit it."""
    saved = {k: os.environ.get(k) for k in (*clear, *values)}
    try:
        for k in clear:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_variant(label: str, variant: Variant, root: Path, target: float) -> dict[str, Any]:
    from kubetrain.trainer.verify import verify_checkpoints

    run = RunDir(root / label)
    started = time.monotonic()
    with _environment(variant.env, clear=(SLOWDOWN_VAR,)):
        code = LocalRunner(from_object(variant.doc), run, out=io.StringIO(), echo_logs=False).run_job()
    wall = round(time.monotonic() - started, 2)
    summary = run.read_summary() or {}
    if code != 0:
        raise RuntimeError(f"bench modes: {label} failed (exit {code}); see {run.path}/logs")
    events = read_events(run.path / "metrics")
    span = training_span(events)
    evaluations = verify_checkpoints(run.path)["evaluations"]
    reached = time_to_accuracy(evaluations, checkpoint_times(events), span.start, target) if span else None
    sps = span.samples_per_second if span else None
    return {
        "samples_per_second": round(sps) if sps else None,
        "time_to_target_seconds": reached[0] if reached else None,
        "target_reached_at_step": reached[1] if reached else None,
        "training_seconds": round(span.end - span.start, 3) if span else None,
        "samples": span.samples if span else None,
        "eval_accuracy": summary.get("eval_accuracy"),
        "best_checkpoint_accuracy": max((e["eval_accuracy"] for e in evaluations), default=None),
        "checkpoints_evaluated": len(evaluations),
        "loop_samples_per_second": round(summary["samples_per_second"]) if summary.get("samples_per_second") else None,
        "bytes_sent": summary.get("bytes_sent"),
        "wall_seconds": wall,
        "env": variant.env,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# The aims, per case: (mode, figure, at least this ratio to DDP's).
AIMS = {"cnn": ("PS-Sync", "samples_per_second", 0.9), "straggler": ("PS-Async", "samples_per_second", 1.3)}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def bench_modes_case(case: str, epochs: int, batch: int, hidden: int, slow_factor: float, target: float,
                     modes: list[str] | None = None, rounds: int = 1) -> dict[str, Any]:
    """Every mode of `case`, `rounds` times in alternating order (ABCD, DCBA, ...); medians of the rounds.

    The order alternates so that a machine getting busier or quieter during
    the run (other work on these shared cores) lands on every mode alike.
    """
    from kubetrain.trainer.data import ShardCursor, load_data

    spec_doc = from_object(mode_variants(case, epochs, batch, 1)["Single"].doc).spec
    assert spec_doc.dataset is not None and spec_doc.training is not None
    train = len(load_data(spec_doc.dataset, 0).train_x)
    steps_per_epoch = ShardCursor(train, 0, 1, batch, 0).steps_per_epoch
    variants = mode_variants(case, epochs, batch, steps_per_epoch, hidden, slow_factor)
    labels = [label for label in variants if not modes or label in modes]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory(prefix=f"kubetrain-bench-{case}-") as tmp:
        for i in range(rounds):
            for label in labels if i % 2 == 0 else labels[::-1]:
                runs[label].append(_run_variant(label, variants[label], Path(tmp) / str(i), target))
    results: dict[str, Any] = {}
    for label, each in runs.items():
        sps = _median([r["samples_per_second"] for r in each])
        tta = _median([r["time_to_target_seconds"] for r in each])
        results[label] = {
            "samples_per_second": round(sps) if sps else None,
            "time_to_target_seconds": round(tta, 3) if tta is not None else None,
            "reached_target_in_rounds": sum(r["time_to_target_seconds"] is not None for r in each),
            "rounds": each,
        }
    ddp = results.get("DDP") or {}
    for label, r in results.items():
        r["samples_per_second_to_ddp"] = _ratio(r["samples_per_second"], ddp.get("samples_per_second"))
        # Above 1: the mode reached the target sooner than DDP.
        r["speedup_to_target_over_ddp"] = _ratio(ddp.get("time_to_target_seconds"), r["time_to_target_seconds"])
        if "DDP" in runs:  # each round's own ratio: how far the rounds agree
            r["samples_per_second_to_ddp_by_round"] = [
                _ratio(a["samples_per_second"], b["samples_per_second"]) for a, b in zip(runs[label], runs["DDP"])]
    model = variants["Single"].doc["spec"]["model"]
    out: dict[str, Any] = {
        "case": case,
        "model": f"{model['name']} {model['args']}",
        "steps": epochs * steps_per_epoch,
        "target_accuracy": target,
        "rounds": rounds,
        "modes": results,
    }
    if case in AIMS:
        mode, figure, least = AIMS[case]
        ratio = (results.get(mode) or {}).get(f"{figure}_to_ddp")
        out["aim"] = {"figure": f"{mode} {figure} / DDP's", "at_least": least, "measured": ratio,
                      "met": ratio is not None and ratio >= least}
    return out


def bench_modes(cases: list[str], epochs: int, batch: int, hidden: int = 128, slow_factor: float = 3.0,
                target: float = 0.9, modes: list[str] | None = None, rounds: int = 1) -> dict[str, Any]:
    """`kubetrain bench modes`: every case in `cases`, each mode through the local backend, one after the other."""
    unknown = [m for m in modes or [] if m not in MODE_LABELS]
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; expected a subset of {','.join(MODE_LABELS)}")
    if not 0 < target <= 1:
        raise ValueError(f"--target {target}: expected an accuracy in (0, 1]")
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: expected at least 1")
    from kubetrain.trainer.errors import ConfigError
    from kubetrain.trainer.testhooks import MAX_FACTOR, parse_slowdown

    try:  # the replicas would refuse it at their start (exit 2): refuse it before any run
        parse_slowdown(f"worker-1:{slow_factor:g}")
    except ConfigError:
        raise ValueError(f"--slow-factor {slow_factor:g}: expected a factor from 1 to {MAX_FACTOR:g}") from None
    return {
        "benchmark": "modes",
        "data": "digits",
        "epochs": epochs,
        "global_batch": batch,
        "note": ("samples_per_second: samples trained / the training's wall time (first replica's start to the "
                 "last train event), every mode alike; time_to_target_seconds: from that start to the first "
                 f"checkpoint ({CHECKPOINTS_PER_EPOCH} an epoch) whose model reaches target_accuracy on the eval "
                 "split; medians of the rounds; ratios are to DDP's in the same run"),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "cases": {case: bench_modes_case(case, epochs, batch, hidden, slow_factor, target, modes, rounds)
                  for case in cases},
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
