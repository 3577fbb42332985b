"""The run directory of a local job: its layout, its state across invocations, atomic writes.

Layout (DESIGN.md): job.yaml (the spec with defaults), plan.json (each
replica's command and environment, as the operator would give its pod),
summary.json (only once the job has ended), metrics/<replica>.jsonl, logs/<replica>.log,
checkpoints/<replica>/, results/<replica>.json, state.json (what the
supervisor must remember across invocations: restarts, accumulated wall time;
the job's status, progress included), events.jsonl (the engine's events) and,
while a `kubetrain run` supervises the run, run.pid.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from kubetrain.shared.checkpoints import RUN_CHECKPOINTS, RUN_JOB_FILE, replica_dir
from kubetrain.shared.files import atomic_write

from kubetrain.api import TrainingJob, dump_manifest, from_object, to_manifest
from kubetrain.api.identity import differences, explain
from kubetrain.api.status import JobStatus, read_status, to_dict


def sizeless(spec: Any) -> Any:
    """A spec without its size (spec.replicas, and the workers or nodes it sets): what must stay the same
    for a run directory to hold the same job, scaled or not."""
    if not isinstance(spec, dict):
        return spec
    out = {k: v for k, v in spec.items() if k != "replicas"}
    for block, key in (("parameterServer", "workers"), ("ddp", "nodes")):
        if isinstance(out.get(block), dict):
            out[block] = {k: v for k, v in out[block].items() if k != key}
    return out


class RunDirError(Exception):
    """The run directory cannot be used; the message names it."""


def scale_run(run_dir: Path, replicas: int) -> TrainingJob:
    """Set a run's size (spec.replicas of its job.yaml), as `kubectl scale` sets a TrainingJob's: a `kubetrain
    run` in progress resizes the job within a second, otherwise the next run starts at that size. RunDirError
    names a directory without a run; InvalidSpec a size the job cannot take (spec.replicas)."""
    job_file = Path(run_dir) / RUN_JOB_FILE
    if not job_file.is_file():
        raise RunDirError(f"{run_dir}: no run here (no job.yaml); start it with `kubetrain run` first")
    try:
        doc = yaml.safe_load(job_file.read_text())
    except yaml.YAMLError as err:
        raise RunDirError(f"{job_file}: not YAML ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise RunDirError(f"{job_file}: not a TrainingJob manifest")
    doc["spec"]["replicas"] = replicas
    job = from_object(doc, str(job_file))
    atomic_write(job_file, dump_manifest(job))
    return job


@dataclass
class RunState:
    """What only a local run keeps beside the job's status (state.json): its wall time, how often it was
    invoked, the torchrun group's starts and the restart log. The state, its reason and the restart
    counts are the status's (`api.status.JobStatus`, decided by the engine), kept here whole; the
    operator's counterpart of this is `drivers.cluster.state.JobState`."""

    wall_seconds: float = 0.0  # accumulated over earlier invocations
    invocations: int = 0
    group_starts: int = 0  # DDP: times the supervisor started the torchrun group
    restart_log: list[dict[str, Any]] | None = None
    status: JobStatus | None = None  # the engine's status (memory included), as the operator keeps it; None: a new run


class RunDir:
    def __init__(self, path: Path):
        self.path = path

    @property
    def job_file(self) -> Path:
        return self.path / RUN_JOB_FILE

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    def log_file(self, replica: str) -> Path:
        return self.path / "logs" / f"{replica}.log"

    def metrics_file(self, replica: str) -> Path:
        return self.path / "metrics" / f"{replica}.jsonl"

    def result_file(self, replica: str) -> Path:
        return self.path / "results" / f"{replica}.json"

    def checkpoint_dir(self, replica: str) -> Path:
        return replica_dir(self.path, replica)

    def prepare(self, job: TrainingJob) -> RunState:
        """Create or reopen the directory for `job`; refuse one that holds another job.

        Checked before anything is written, so a refused directory is left as it was.
        """
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"{self.path}: exists and is not a directory")
        if self.job_file.exists():
            try:
                old_doc = yaml.safe_load(self.job_file.read_text())
            except yaml.YAMLError:
                old_doc = None
            if not isinstance(old_doc, dict) or not isinstance(old_doc.get("spec"), dict):
                raise RunDirError(f"{self.path}: its {self.job_file.name} is not a TrainingJob manifest; use another "
                                  "--run-dir or delete this one")
            # Field by field, a field the stored manifest lacks counting as its default: a run directory written
            # by an earlier release (before a field with a default existed) reopens with the same manifest.
            changed = differences(sizeless(old_doc["spec"]), sizeless(to_manifest(job)["spec"]))
            if changed:
                raise RunDirError(
                    f"{self.path}: holds a run of a different spec (see {self.job_file}): "
                    f"{explain(changed, recorded='in the run', current='in this manifest')}; "
                    "use another --run-dir or delete this one"
                )
            if job.spec.replicas is None and isinstance(old_doc["spec"].get("replicas"), int):
                # Scaled (`kubetrain scale`) since the manifest was written: the run keeps that size.
                job.spec.replicas = old_doc["spec"]["replicas"]
                job.spec.complete()
            if old_doc.get("spec") != to_manifest(job)["spec"]:
                atomic_write(self.job_file, dump_manifest(job))  # the manifest's own spec.replicas: a resize
        try:
            for sub in ("logs", "metrics", "results", RUN_CHECKPOINTS):
                (self.path / sub).mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise RunDirError(f"{self.path}: cannot write here ({err.strerror})") from None
        if not self.job_file.exists():
            atomic_write(self.job_file, dump_manifest(job))
        return self.load_state()

    def load_state(self) -> RunState:
        if not self.state_file.exists():
            return RunState()
        data = json.loads(self.state_file.read_text())
        fields = {k: v for k, v in data.items() if k in RunState.__dataclass_fields__}
        status = fields.pop("status", None)
        return RunState(**fields, status=read_status(status) if status is not None else None)

    def save_state(self, state: RunState) -> None:
        """state.json: the run's own fields, and the status as the API stores it (camelCase)."""
        data = asdict(replace(state, status=None))
        data["status"] = to_dict(state.status) if state.status is not None else None
        atomic_write(self.state_file, json.dumps(data, indent=2) + "\n")

    @property
    def targets_file(self) -> Path:
        return self.path / "targets.json"

    def write_targets(self, job: TrainingJob, replicas: list[Any]) -> None:
        """The replicas' /metrics endpoints in Prometheus's file_sd format.

        Ports are picked free at every start, so this is rewritten each time;
        a Prometheus with `file_sd_configs` on this file follows the job. The
        labels are the ones the trainer's series carry, so process metrics
        (process_start_time_seconds, ...) get them too; scrape with
        `honor_labels: true` so the series' own labels win.
        """
        groups = [
            {
                "targets": [f"127.0.0.1:{r.ports['metrics']}"],
                "labels": {"namespace": job.metadata.namespace, "job": job.name, "role": r.role, "replica": r.name},
            }
            for r in replicas
            if r.ports.get("metrics")
        ]
        atomic_write(self.targets_file, json.dumps(groups, indent=2) + "\n")

    @property
    def plan_file(self) -> Path:
        return self.path / "plan.json"

    def write_plan(self, replicas: list[Any]) -> None:
        """The plan this invocation runs: per replica its command and the KUBETRAIN_* environment
        (the token left out), to read next to a cluster's pod specs."""
        plan = [{"replica": r.name, "command": list(r.command), "env": dict(r.env), "ports": dict(r.ports)}
                for r in replicas]
        atomic_write(self.plan_file, json.dumps(plan, indent=2) + "\n")

    @property
    def pid_file(self) -> Path:
        return self.path / "run.pid"

    def write_pid(self) -> None:
        """This process supervises the run (`kubetrain run`): the client tells a live run by it."""
        atomic_write(self.pid_file, f"{os.getpid()}\n")

    def clear_pid(self) -> None:
        self.pid_file.unlink(missing_ok=True)

    def supervisor(self) -> int | None:
        """The pid of the `kubetrain run` that supervises this run now, or None when none does (it ended,
        or was killed and left its pid file behind)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if process_alive(pid) else None

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    def append_event(self, time: float, kind: str, reason: str, message: str) -> None:
        """One event the engine decided (what a cluster records as a Kubernetes Event of the job)."""
        with open(self.events_file, "a") as f:
            f.write(json.dumps({"time": time, "type": kind, "reason": reason, "message": message}) + "\n")

    def read_summary(self) -> dict[str, Any] | None:
        if not self.summary_file.exists():
            return None
        return json.loads(self.summary_file.read_text())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.summary_file, json.dumps(summary, indent=2) + "\n")

    def results(self) -> dict[str, dict[str, Any]]:
        out = {}
        for f in sorted((self.path / "results").glob("*.json")):
            try:
                out[f.stem] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
        return out

    def events(self, replica: str) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_file(replica))


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a line cut by a kill is ignored."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
