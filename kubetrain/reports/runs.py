"""What a report needs from one run directory: the job, its summary, restarts, and event series."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetrain.api import InvalidSpec, TrainingJob, load_one
from kubetrain.engine.plan import chief
from kubetrain.drivers.local.rundir import RunDir, read_jsonl


class ReportError(Exception):
    """A run directory that cannot be reported on; the message names it and what is missing."""


@dataclass
class Recovery:
    """One restart of one replica and how long the job took to train again."""

    replica: str
    reason: str
    exit_code: int | None
    failed_at: float  # unix time the supervisor saw the failure
    failed_step: int | None
    resumed_step: int | None  # the step the new process resumed from (its `resume` event)
    recovery_seconds: float | None  # failure to the first step of the new process; None if it never trained

    @property
    def steps_lost(self) -> int | None:
        if self.failed_step is None or self.resumed_step is None:
            return None
        return max(0, self.failed_step - self.resumed_step)


@dataclass
class RunData:
    path: Path
    label: str
    job: TrainingJob
    summary: dict[str, Any]
    results: dict[str, dict[str, Any]]
    events: dict[str, list[dict[str, Any]]]  # replica -> its events, in order
    recoveries: list[Recovery] = field(default_factory=list)
    start_time: float = 0.0  # unix time of the first event of any replica

    @property
    def chief(self) -> str:
        return chief(self.job)

    @property
    def compression(self) -> str:
        spec = self.job.spec
        if spec.mode == "ParameterServer" and spec.parameter_server is not None:
            return spec.parameter_server.compression.algorithm
        if spec.mode == "DDP" and spec.ddp is not None:
            return spec.ddp.comm_hook
        return "None"

    def series(self, event: str, key: str, replica: str | None = None) -> list[tuple[int, float, float]]:
        """(step, seconds since the run's start, value) of `key` in `event` events of one replica (the chief)."""
        out = []
        for e in self.events.get(replica or self.chief, []):
            if e.get("event") == event and e.get(key) is not None and e.get("step") is not None:
                out.append((int(e["step"]), float(e["time"]) - self.start_time, float(e[key])))
        return out

    def sample_points(self) -> list[tuple[float, int]]:
        """(seconds since start, samples trained since the previous event) of every data replica.

        From the cumulative `samples` of the `train` events. A restarted replica
        resumes its count from the checkpoint, so a step backwards is a
        restart, not negative throughput: skipped.
        """
        points: list[tuple[float, int]] = []
        for events in self.events.values():
            last = None
            for e in events:
                if e.get("event") != "train" or e.get("samples") is None:
                    continue
                t, samples = float(e["time"]) - self.start_time, int(e["samples"])
                if last is not None and samples > last[1] and t > last[0]:
                    points.append((t, samples - last[1]))
                last = (t, samples)
        return sorted(points)

    def throughput(self, width: float) -> list[tuple[float, float]]:
        """(bin centre in seconds since start, samples/s of all data replicas) in bins of `width` seconds."""
        points = self.sample_points()
        if not points or width <= 0:
            return []
        totals = [0.0] * (int(points[-1][0] / width) + 1)
        for t, n in points:
            totals[int(t / width)] += n
        return [((i + 0.5) * width, total / width) for i, total in enumerate(totals)]


def _events_by_replica(run: RunDir) -> dict[str, list[dict[str, Any]]]:
    metrics = run.path / "metrics"
    if not metrics.is_dir():
        return {}
    return {f.stem: read_jsonl(f) for f in sorted(metrics.glob("*.jsonl"))}


def _recoveries(restart_log: list[dict[str, Any]], events: dict[str, list[dict[str, Any]]]) -> list[Recovery]:
    out = []
    for entry in restart_log:
        replica, failed_at = entry["replica"], float(entry["time"])
        later = [e for e in events.get(replica, []) if float(e.get("time", 0)) > failed_at]
        resume = next((e for e in later if e.get("event") in ("resume", "start")), None)
        trained = next((e for e in later if e.get("event") == "train"), None)
        out.append(
            Recovery(
                replica=replica,
                reason=entry.get("reason", ""),
                exit_code=entry.get("exit_code"),
                failed_at=failed_at,
                failed_step=entry.get("step"),
                resumed_step=resume.get("step") if resume else None,
                recovery_seconds=float(trained["time"]) - failed_at if trained else None,
            )
        )
    return out


def load_run(path: Path, label: str | None = None) -> RunData:
    """Read a run directory written by `kubetrain run`; ReportError names what is missing."""
    run = RunDir(Path(path))
    if not run.path.is_dir():
        raise ReportError(f"{run.path}: no such run directory")
    if not run.job_file.exists():
        raise ReportError(f"{run.path}: not a run directory (no job.yaml)")
    try:
        job = load_one(run.job_file)
    except InvalidSpec as err:
        raise ReportError(f"{run.job_file}: not a valid TrainingJob: {'; '.join(map(str, err.problems))}") from None
    summary = run.read_summary()
    if summary is None:
        raise ReportError(f"{run.path}: the run has not ended (no summary.json); finish it with `kubetrain run` first")
    events = _events_by_replica(run)
    times = [float(e["time"]) for es in events.values() for e in es if "time" in e]
    state = json.loads(run.state_file.read_text()) if run.state_file.exists() else {}
    return RunData(
        path=run.path,
        label=label or run.path.name,
        job=job,
        summary=summary,
        results=run.results(),
        events=events,
        recoveries=_recoveries(state.get("restart_log") or [], events),
        start_time=min(times) if times else 0.0,
    )
