"""Live parts of the observability tests: background `kubetrain run` jobs, their processes, the Prometheus
configuration that scrapes them (helpers.prometheus runs it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from catalogue import ALERTS
from helpers.process import stop_process
from helpers.prometheus import Prometheus
from kubetrain.shared.launch import SLOWDOWN_VAR
from support import ROOT, job_doc

SCRAPE_SECONDS = 1
# The rules' minutes become 2 s: a 10-minute window is 20 s here, long enough
# for a replica to restart a few times on a loaded 2-core machine.
TIME_SCALE = 30
SINGLE, PS, FT = "obs-single", "obs-ps", "obs-ft"
UNTIL_STOPPED = 10**7  # maxSteps of the jobs: they train until the session stops them
# The jobs train for the whole module (minutes of waiting for alerts), and at full speed each replica
# takes every idle cycle of the machine (the module cost ~250 CPU seconds). The benchmarks' straggler
# knob (kubetrain/trainer/testhooks.py) makes each training replica sleep 99 times its step's compute after each
# step: ~8 steps a second, still a moving step at every scrape (1 s), a Single checkpoint every ~6 s
# (intervalSteps 50) against the stale alert's 60 s window here.
SLOWDOWN_FACTOR = 100


def _ms(text: str) -> int:
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Prometheus duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def scale_duration(text: str) -> str:
    return f"{max(1, _ms(text) // TIME_SCALE)}ms"


def scaled_rules(doc: dict) -> dict:
    """The alert rules with every duration (ranges, subquery steps, offsets, `for`) divided by TIME_SCALE."""
    doc = json.loads(json.dumps(doc))
    for group in doc["groups"]:
        for rule in group["rules"]:
            expr = re.sub(
                r"\[([^\]]+)\]", lambda m: "[" + ":".join(scale_duration(d) for d in m.group(1).split(":")) + "]",
                rule["expr"],
            )
            rule["expr"] = re.sub(r"\boffset (\w+)", lambda m: "offset " + scale_duration(m.group(1)), expr)
            if "for" in rule:
                rule["for"] = scale_duration(rule["for"])
    return doc


def replica_pids(run_dir: Path, replica: str) -> list[int]:
    """Live processes of a replica of this run, found by the environment the local backend gave them."""
    wanted = {f"KUBETRAIN_RUN_DIR={run_dir}".encode(), f"KUBETRAIN_REPLICA={replica}".encode()}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            if wanted <= env and os.getpgid(int(entry.name)) == int(entry.name):
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue  # gone, or not ours
    return pids


@dataclass
class LiveRun:
    """A `kubetrain run` in the background, with its run directory."""

    name: str
    replicas: list[str]
    run_dir: Path
    popen: subprocess.Popen
    log: Path

    def targets(self) -> list[dict]:
        path = self.run_dir / "targets.json"
        return json.loads(path.read_text()) if path.exists() else []

    def pid(self, replica: str) -> int:
        pids = replica_pids(self.run_dir, replica)
        assert len(pids) == 1, f"{self.name}: expected one process of {replica}, found {pids}"
        return pids[0]

    def stop(self) -> None:
        for replica in self.replicas:
            for pid in replica_pids(self.run_dir, replica):
                _signal(pid, signal.SIGCONT)  # a frozen replica could not take its SIGTERM
        stop_process(self.popen, timeout=60)
        for replica in self.replicas:
            for pid in replica_pids(self.run_dir, replica):
                _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Observed:
    """The session's Prometheus and jobs, and what the replicas exposed once all were training."""

    prometheus: Prometheus
    runs: dict[str, LiveRun]
    expositions: dict[str, str] = field(default_factory=dict)  # replica ("obs-ps/worker-0") -> text


def jobs(data_uri: str = "", checkpoint_uri: str = "") -> dict[str, dict]:
    """The three jobs; with the URIs, obs-single reads its data from s3:// shards and keeps its checkpoints in a
    bucket (the dashboard's object-storage panels have its series)."""
    never = {"policy": "OnFailure", "backoffLimit": 30, "maxRestartsWithoutProgress": 30}
    run_policy = {"progressDeadlineSeconds": 3600}  # the stall below must stay a stall, not a restart
    training = {"maxSteps": UNTIL_STOPPED, "batchSize": 32, "seed": 0,
                "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}}
    common = {"model": {"name": "mlp", "args": {"hidden": 64}}, "dataset": {"name": "digits"},
              "training": training, "restartPolicy": never, "runPolicy": run_policy}
    return {
        # Checkpoints often: its restarts (one by --fault, more by the test) make progress.
        SINGLE: job_doc(SINGLE, "Single", **{**common, **({"dataset": {"uri": data_uri}} if data_uri else {})},
                        checkpoint={"intervalSteps": 50, "keepLast": 2,
                                    **({"storage": {"uri": checkpoint_uri}} if checkpoint_uri else {})}),
        # Async with TopK: staleness and compressed bytes; never checkpoints while the test runs.
        PS: job_doc(PS, "ParameterServer", checkpoint={"intervalSteps": UNTIL_STOPPED, "keepLast": 1},
                    parameterServer={"replicas": 1, "workers": 2, "aggregation": "Async", "maxStaleness": 4,
                                     "syncTimeoutSeconds": 3600,
                                     "compression": {"algorithm": "TopK", "ratio": 0.1, "minTensorBytes": 1024}},
                    **common),
        # Fault-tolerant DDP, two replica groups and a Lighthouse: its group ddp-1 is killed once (--fault) and
        # its replacement heals from ddp-0, so the dashboard's quorum, commit and heal panels have data.
        FT: job_doc(FT, "DDP", checkpoint={"intervalSteps": 500, "keepLast": 1},
                    ddp={"nodes": 2, "procsPerNode": 1, "faultTolerance": {}}, **common),
    }


def start_run(root: Path, name: str, doc: dict, replicas: list[str], extra: list[str], nice: int = 0,
              environ: dict[str, str] | None = None) -> LiveRun:
    """`kubetrain run` in the background (`environ` added to its environment); `nice` lowers the priority of
    it and its replicas."""
    manifest = root / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = root / "runs" / name
    log = root / f"{name}.log"
    popen = subprocess.Popen(
        [sys.executable, "-m", "kubetrain.cli", "run", str(manifest), "--run-dir", str(run_dir), "--quiet",
         *extra],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        env={**os.environ, **(environ or {}), SLOWDOWN_VAR: ",".join(f"{r}:{SLOWDOWN_FACTOR}" for r in replicas)},
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    return LiveRun(name, replicas, run_dir, popen, log)


def run_scrape_config(name: str, run_dir: Path) -> dict:
    """Scrape one run through its targets.json.

    The file labels every target with namespace, job, role and replica, so the
    process collectors' series get them too; honor_labels keeps the trainer's
    own (identical) labels.
    """
    return {
        "job_name": name,
        "honor_labels": True,
        "file_sd_configs": [{"files": [str(run_dir / "targets.json")], "refresh_interval": "1s"}],
    }


def prometheus_config(root: Path, runs: dict[str, Path]) -> Path:
    rules = root / "alerts.yaml"
    rules.write_text(yaml.safe_dump(scaled_rules(yaml.safe_load(ALERTS.read_text())), sort_keys=False))
    config = {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "scrape_timeout": f"{SCRAPE_SECONDS}s",
                   "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            *(run_scrape_config(name, run_dir) for name, run_dir in runs.items()),
        ],
    }
    path = root / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
