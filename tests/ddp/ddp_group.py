"""Real torchrun groups on loopback: one torchrun per node, with the operator's argv, and what they wrote."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from helpers.jsonl import read_events
from helpers.net import free_port
from kubetrain.api import load_one
from kubetrain.shared.launch import torchrun_command

# Seconds; a healthy group of these tests ends within a minute on an idle
# 2-core machine, a few times that on a shared one.
GROUP_TIMEOUT = 300

# Digits, MLP, 2 ranks of batch 32: about 23 steps an epoch, 230 in all.
BASE_SPEC: dict[str, Any] = {
    "mode": "DDP",
    "model": {"name": "mlp", "args": {"hidden": 64}},
    "dataset": {"name": "digits"},
    "training": {"epochs": 10, "batchSize": 32, "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}},
    "ddp": {"nodes": 2, "procsPerNode": 1, "backend": "gloo", "commHook": "None", "maxRestarts": 2},
    "checkpoint": {"intervalSteps": 20, "keepLast": 3},
    "metrics": {"port": 0},
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def write_job(directory: Path, name: str = "ddp-test", **override: Any) -> Path:
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": merge(BASE_SPEC, override)}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def rank_env(run_dir: Path, job_file: Path, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "TORCHELASTIC_"))}
    env.update(
        KUBETRAIN_JOB_FILE=str(job_file),
        KUBETRAIN_RUN_DIR=str(run_dir),
        KUBETRAIN_REPLICA=f"ddp-{node}",
        KUBETRAIN_CHECKPOINT_DIR=str(run_dir / "checkpoints" / f"ddp-{node}"),
        KUBETRAIN_METRICS_PORT="0",
        GLOO_SOCKET_IFNAME="lo",  # keep the ranks' traffic on loopback
        OMP_NUM_THREADS="1",
    )
    env.update(extra or {})
    return env


@dataclass
class Group:
    """A finished (or stopped) run of one DDP job: exit codes, logs, and what the ranks wrote."""

    run_dir: Path
    returncodes: list[int]
    logs: list[str]
    seconds: float

    def result(self, rank: int) -> dict[str, Any]:
        return json.loads((self.run_dir / "results" / f"ddp-{rank}.json").read_text())

    def events(self, rank: int, event: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "metrics" / f"ddp-{rank}.jsonl", event)

    def attempts(self, rank: int, event: str) -> list[list[int]]:
        """Steps of `event` per attempt of the rank (each attempt begins with a `start` event)."""
        out: list[list[int]] = []
        for e in self.events(rank):
            if e["event"] == "start":
                out.append([])
            elif e["event"] == event:
                out[-1].append(e["step"])
        return out

    def losses(self) -> dict[int, float]:
        """Global mean training loss by step, as rank 0 logged it (the last attempt wins)."""
        return {e["step"]: e["loss"] for e in self.events(0, "train")}


@dataclass
class Nodes:
    """One torchrun per node on loopback, started with the operator's own argv."""

    job_file: Path
    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    metrics_ports: list[int] = field(default_factory=list)
    """/metrics port of each node's first rank (its others take the next ones); none when empty."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: float = 0.0

    def start(self) -> "Nodes":
        spec = load_one(self.job_file).spec
        endpoint = f"127.0.0.1:{free_port()}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        for node in range(spec.ddp.nodes):
            argv = torchrun_command(spec, node, endpoint, self.run_dir.name, python=sys.executable,
                                    local_addr="127.0.0.1")
            log = open(self.run_dir / f"node-{node}.log", "w")
            env = dict(self.env)
            if self.metrics_ports:
                env["KUBETRAIN_METRICS_PORT"] = str(self.metrics_ports[node])
            self.procs.append(subprocess.Popen(
                argv, env=rank_env(self.run_dir, self.job_file, node, env),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        return self

    def wait(self, timeout: float = GROUP_TIMEOUT) -> Group:
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            for p in self.procs:  # a hung group must not outlive its test
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        logs = [(self.run_dir / f"node-{n}.log").read_text() for n in range(len(self.procs))]
        return Group(self.run_dir, codes, logs, time.monotonic() - self.started)


def run_group(job_file: Path, run_dir: Path, env: dict[str, str] | None = None) -> Group:
    return Nodes(job_file, run_dir, env or {}).start().wait()


def assert_ok(group: Group) -> None:
    assert group.returncodes == [0] * len(group.returncodes), "\n".join(log[-3000:] for log in group.logs)
