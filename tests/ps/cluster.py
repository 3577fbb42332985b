"""Start a parameter-server job as real processes on loopback, the way a supervisor would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from helpers.jsonl import read_events
from helpers.net import free_ports
from kubetrain.api import from_object
from kubetrain.trainer.context import ReplicaContext
from kubetrain.trainer.session import JobCheckpoints
from kubetrain.trainer.events import EventLog
from kubetrain.trainer.metrics import TrainerMetrics

TOKEN = "test-token-0123456789"
JOB_SECONDS = 120  # a job of the quickstart's size, 10 epochs, on a busy 2-core machine


@contextmanager
def ticking(shard, every: float) -> Iterator[None]:
    """Tick a shard every `every` seconds while the block runs, as serve.py does (its Sync timeout, its watchdog)."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            shard.tick()

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()

def manifest(name: str, **ps_fields) -> dict:
    compression = ps_fields.pop("compression", {})
    checkpoint = ps_fields.pop("checkpoint", {"intervalSteps": 20, "keepLast": 3})
    training = {"epochs": 10, "batchSize": 16, "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}, "seed": 0, "device": "cpu"}
    training.update(ps_fields.pop("training", {}))
    return {
        "apiVersion": "kubetrain.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "mode": "ParameterServer",
            "model": {"name": "mlp", "args": {"hidden": 128}},
            "dataset": {"name": "digits", "evalFraction": 0.2},
            "training": training,
            "parameterServer": {"replicas": 1, "workers": 2, "aggregation": "Sync", "syncTimeoutSeconds": 5,
                                "compression": compression, **ps_fields},
            "checkpoint": checkpoint,
            "metrics": {"port": 0},
        },
    }


def shard_checkpoints(directory: Path, metrics: TrainerMetrics | None = None) -> JobCheckpoints:
    """The job's checkpoints for a shard a test builds itself, as serve.py gives them to it: synchronous saves
    into `directory`/checkpoints (keep 2), events into `directory`/metrics."""
    job = from_object(manifest("shard", checkpoint={"intervalSteps": 20, "keepLast": 2}), "test")
    ctx = ReplicaContext(job=job, replica="ps-0", run_dir=directory, checkpoint_dir=directory / "checkpoints")
    return JobCheckpoints(ctx, metrics or TrainerMetrics(ctx), EventLog(directory, ctx.replica), background=False)


@dataclass
class Job:
    """The processes of one job; `start(replica)` (re)starts one as a supervisor would."""

    run_dir: Path
    doc: dict
    ports: list[int] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)  # more variables for every replica
    data_ports: list[int] = field(default_factory=list)
    """Each shard's data plane (Pull and Push, as the operator plans a job); empty: gRPC only."""

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.job_file = self.run_dir / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(self.doc))
        ps = self.doc["spec"]["parameterServer"]
        ports = free_ports(2 * ps["replicas"])
        self.ports, self.data_ports = ports[: ps["replicas"]], ports[ps["replicas"]:]
        self.replicas = ([f"ps-{i}" for i in range(ps["replicas"])] + [f"worker-{i}" for i in range(ps["workers"])]
                         + [f"standby-{i}" for i in range(ps.get("standbyWorkers", 0))])

    def env(self, replica: str, fault: str = "") -> dict[str, str]:
        index = int(replica.rsplit("-", 1)[1])
        env = {
            **os.environ,
            "KUBETRAIN_JOB_FILE": str(self.job_file),
            "KUBETRAIN_REPLICA": replica,
            "KUBETRAIN_RUN_DIR": str(self.run_dir),
            "KUBETRAIN_CHECKPOINT_DIR": str(self.run_dir / "checkpoints" / replica),
            "KUBETRAIN_METRICS_PORT": "0",
            "KUBETRAIN_PS_ADDRS": ",".join(f"127.0.0.1:{p}" for p in self.ports),
            "KUBETRAIN_PS_DATA_ADDRS": ",".join(f"127.0.0.1:{p}" for p in self.data_ports),
            "KUBETRAIN_JOB_TOKEN": TOKEN,
            "KUBETRAIN_FAULT": fault,
            **self.environ,
        }
        if replica.startswith("ps-"):
            env["KUBETRAIN_PS_PORT"] = str(self.ports[index])
            env["KUBETRAIN_PS_DATA_PORT"] = str(self.data_ports[index])
        return env

    def start(self, replica: str, fault: str = "") -> subprocess.Popen:
        role = replica.rsplit("-", 1)[0]
        log = open(self.run_dir / f"{replica}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "kubetrain.trainer", role], env=self.env(replica, fault),
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[replica] = proc
        return proc

    def start_all(self, faults: dict[str, str] | None = None) -> None:
        for replica in self.replicas:
            self.start(replica, (faults or {}).get(replica, ""))

    def wait(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        for replica, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"{replica} still running after {timeout} s; logs:\n{self.logs()}") from None
        return {r: p.returncode for r, p in self.procs.items()}

    def wait_for_exit(self, replica: str, timeout: float) -> tuple[int, float]:
        """Exit code of one replica and the time.time() it was seen gone."""
        try:
            code = self.procs[replica].wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{replica} did not exit within {timeout} s; logs:\n{self.logs()}") from None
        return code, time.time()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.run_dir.glob("*.log")))

    def result(self, replica: str) -> dict:
        return json.loads((self.run_dir / "results" / f"{replica}.json").read_text())

    def events(self, replica: str, event: str | None = None) -> list[dict]:
        """The replica's event log so far ([] before it started), only `event`s when given."""
        return read_events(self.run_dir / "metrics" / f"{replica}.jsonl", event)


def run_job(tmp_path, name, faults=None, **ps_fields) -> Job:
    """A job of `manifest(name, **ps_fields)` run to its end; every replica must exit 0."""
    job = Job(tmp_path / name, manifest(name, **ps_fields))
    job.start_all(faults)
    try:
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    return job
