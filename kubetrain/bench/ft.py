"""`kubetrain bench ft`: what a lost node costs a fault-tolerant DDP job, with and without a spare group,
beside today's restart from a checkpoint.

One run, six variants of one job through `kubetrain run` (real processes, one after the other): the
fault-tolerant job (spec.ddp.faultTolerance, each node a replica group), the same with one spare group
(`spareGroups: 1`: a group beside the nodes that trains nothing until a group is lost), and the same job as
plain DDP (one torchrun group of every node, restarted from its newest checkpoint), each with no kill and
with one group's node SIGKILLed every `--kill-every` seconds. For each: the effective rate, the samples the
committed steps trained per second of wall time from the moment every node trains to the job's end (the
data follows the quorum: a step with a group missing trains fewer samples, and a plain group's steps lost to
a restart count as never made), their ratio killed over not killed (the aim with a spare: at least 0.95),
and the accuracy killed minus not killed. For every kill of a fault-tolerant job: the time back to full
width (the kill to the first commit with ddp.nodes groups training: the spare's, or the replacement's), the
survivors' stall, the time until the replacement takes part again and where it went (the supervisor
noticing, the node's agent and torch, the rank's model and data, torchft's Manager, the heal from a peer,
the first commit); for the plain job, the time from each kill to the group's first step again and the steps
it lost.

A benchmark, not a test: it prints figures, it asserts nothing (docs/benchmarks.md keeps them).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kubetrain.shared.launch import SLOWDOWN_VAR, STARTUP_TAG
from kubetrain.drivers.local.progress import JsonlTail

from .jobs import manifest

POLL_SECONDS = 0.1
"""How often the benchmark reads the run directory while a variant runs (the kill clock's resolution)."""
START_TIMEOUT_SECONDS = 300
"""A variant whose every node has not trained within this long is reported as failed to start."""
RUN_TIMEOUT_SECONDS = 1800
"""A variant still running this long after every node trained is stopped and reported as failed (a few
minutes each here)."""
QUIET_END_FRACTION = 0.02
"""No kill in the job's last 2 % of steps: a plain group's node killed as the others end waited at a
rendezvous the finished nodes never joined, restarted and killed again every 30 s (seen once, a bench stuck)."""
MILESTONE = f"{STARTUP_TAG} "


BATCH = 32
"""Samples a node trains a step."""
SPARE_AIM = 0.95
"""The effective rate with a spare group under a kill every 30 s over no kill (the issue's aim)."""


def job_doc(name: str, steps: int, groups: int, fault_tolerant: bool, hidden: int, heartbeat: float,
            spares: int = 0) -> dict[str, Any]:
    ddp: dict[str, Any] = {"nodes": groups, "procsPerNode": 1, "backend": "gloo"}
    if fault_tolerant:
        ddp["faultTolerance"] = {"heartbeatTimeoutSeconds": heartbeat, "spareGroups": spares}
    return manifest(name, {
        "mode": "DDP",
        "model": {"name": "mlp", "args": {"hidden": hidden}},
        "dataset": {"name": "digits"},
        "training": {"maxSteps": steps, "batchSize": BATCH, "seed": 0, "device": "cpu",
                     "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}},
        "ddp": ddp,
        "checkpoint": {"intervalSteps": 100, "keepLast": 2},
        # Kills every few seconds for minutes: neither budget may end the job.
        "restartPolicy": {"backoffLimit": 1000, "maxRestartsWithoutProgress": 1000},
        "metrics": {"port": 0},
    })


def events(run: Path, replica: str) -> list[dict[str, Any]]:
    """A replica's event log as it is now (a line cut by a kill left out)."""
    return JsonlTail(run / "metrics" / f"{replica}.jsonl").read()


def milestones(log: Path, after: float) -> list[dict[str, Any]]:
    """The start-up milestones (trainer/events.startup) a node's processes wrote after `after` (unix s)."""
    out = []
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        if line.startswith(MILESTONE):
            try:
                found = json.loads(line[len(MILESTONE):])
            except ValueError:
                continue
            if found.get("time", 0) >= after:
                out.append(found)
    return out


class Variant:
    """One `kubetrain run` of the job, killed on a clock, and what its replicas wrote."""

    def __init__(self, root: Path, name: str, groups: int, spares: int = 0, steps: int = 0):
        self.root, self.name, self.steps = root, name, steps
        self.dir = root / name
        self.nodes = groups
        self.groups = [f"ddp-{i}" for i in range(groups + spares)]
        self.proc: subprocess.Popen | None = None
        self.kills: list[tuple[str, float]] = []
        """(node, unix time) of every kill made."""

    def start(self, doc: dict[str, Any], slowdown: float) -> "Variant":
        path = self.root / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        env = dict(os.environ)
        if slowdown > 1:
            env[SLOWDOWN_VAR] = ",".join(f"{g}:{slowdown:g}" for g in self.groups)
        self.proc = subprocess.Popen([sys.executable, "-m", "kubetrain.cli", "run", str(path), "--run-dir",
                                     str(self.dir), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)
        return self

    def all_training_since(self) -> float | None:
        """When every node had trained a step (the later of their first `train` events), or None yet (a
        spare group writes its steps' events too, with nothing trained)."""
        firsts = []
        for group in self.groups:
            train = [e["time"] for e in events(self.dir, group) if e["event"] == "train"]
            if not train:
                return None
            firsts.append(train[0])
        return max(firsts)

    def kill(self, node: str) -> None:
        """SIGKILL the node's torchrun agent and its ranks (its process group), as a node's death does."""
        starts = [e for g in self.groups for e in events(self.dir, g)
                  if e["event"] == "start" and e.get("node_replica") == node]
        if not starts:
            return
        # The newest: a plain group's restart deals the ranks to the nodes anew (c10d), so a rank's
        # event log names another node after it.
        newest = max(starts, key=lambda e: e["time"])
        try:
            os.killpg(os.getpgid(newest["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            return  # that attempt is gone already: no kill this time
        self.kills.append((node, time.time()))

    def run(self, kill_every: float | None) -> tuple[float, float]:
        """Run to the end, a node killed every `kill_every` s from the moment all trained (rotating over
        the nodes but the first: the one that hosts a plain group's rendezvous dies too, as any other,
        but a fault-tolerant job's chief would make the status read from another group). (t0, end)."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        t0 = None
        while t0 is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bench ft: {self.dir.name} did not start training; see {self.dir}/logs")
            time.sleep(POLL_SECONDS)
            t0 = self.all_training_since()
        victims = self.groups[1:] or self.groups
        n = 0
        stop_at = time.monotonic() + RUN_TIMEOUT_SECONDS
        while self.proc.poll() is None:
            if time.monotonic() > stop_at:
                self.stop()
                raise RuntimeError(f"bench ft: {self.dir.name} ran past {RUN_TIMEOUT_SECONDS} s; see {self.dir}/logs")
            if kill_every is not None and time.time() >= t0 + (n + 1) * kill_every:
                if self.near_end():
                    kill_every = None  # the end is near: no more kills
                else:
                    self.kill(victims[n % len(victims)])
                    n += 1
            time.sleep(POLL_SECONDS)
        if self.proc.returncode != 0:
            raise RuntimeError(f"bench ft: {self.dir.name} failed (exit {self.proc.returncode}); see {self.dir}/logs")
        return t0, max(e["time"] for g in self.groups for e in events(self.dir, g) if e["event"] == "end")

    def near_end(self) -> bool:
        """Whether the job is in its last QUIET_END_FRACTION of steps, or a node has ended (nominal steps: a
        fault-tolerant job with groups missing commits more, but the last of them is past these)."""
        newest = 0
        for group in self.groups:
            for e in events(self.dir, group):
                if e["event"] == "end":
                    return True
                if e["event"] == "train":
                    newest = max(newest, e["step"])
        return newest >= self.steps * (1 - QUIET_END_FRACTION)

    def step_at(self, t: float) -> int:
        """The job's committed step at time t: the newest `train` or `resume` event of any rank (a restarted
        plain group resumes at its checkpoint's step: its lost steps count as never made)."""
        best = (0.0, 0)
        for group in self.groups:
            for e in events(self.dir, group):
                if e["event"] in ("train", "resume") and e["time"] <= t and e["time"] >= best[0]:
                    best = (e["time"], e["step"])
        return best[1]

    def samples_at(self, t: float) -> int:
        """The samples the job's committed steps trained by time t: a fault-tolerant step's event counts them
        (`job_samples`, its cursor's); a plain group's step trains every node's batch (a restarted group
        resumes at its checkpoint's step)."""
        best: tuple[float, int] = (0.0, 0)
        for group in self.groups:
            for e in events(self.dir, group):
                if e["event"] in ("train", "resume") and best[0] <= e["time"] <= t:
                    best = (e["time"], e.get("job_samples", e["step"] * self.nodes * BATCH))
        return best[1]

    def rate(self, kill_every: float | None) -> dict[str, Any]:
        t0, end = self.run(kill_every)
        summary = json.loads((self.dir / "summary.json").read_text())
        start_step, start_samples = self.step_at(t0), self.samples_at(t0)
        samples = self.samples_at(end) - start_samples
        return {"samples_per_second": round(samples / (end - t0), 1),
                "committed_steps_per_second": round((summary["steps"] - start_step) / (end - t0), 2),
                "seconds": round(end - t0, 2), "steps": summary["steps"] - start_step, "samples": samples,
                "kills": len(self.kills), "restarts": summary["restarts"], "eval_accuracy": summary["eval_accuracy"]}

    # -- after a run: each kill, from what the replicas wrote ------------------------------------

    def ft_kills(self) -> list[dict[str, Any]]:
        restarts = json.loads((self.dir / "state.json").read_text())["restart_log"]
        out = []
        for node, killed in self.kills:
            survivors = [g for g in self.groups if g != node]
            stalls = [e["stall_seconds"] for g in survivors for e in events(self.dir, g)
                      if e["event"] == "quorum" and e["time"] > killed and e.get("previous") is not None
                      and e["participants"] < e["previous"] and e.get("stall_seconds") is not None]
            stalls = stalls[:len(survivors)]  # each survivor's first stall after this kill
            mine = [e for e in events(self.dir, node) if e["time"] > killed]
            joined = next((e for e in mine if e["event"] == "quorum"), None)
            heal = next((e for e in mine if e["event"] == "heal"), None)
            restart = next((r for r in restarts if r["replica"] == node and r["time"] >= killed), None)
            found = {m["milestone"]: m["time"] for m in reversed(milestones(self.dir / "logs" / f"{node}.log", killed))}
            # Full width again: the first commit after the kill with ddp.nodes groups training (quorum events are
            # written at a commit under another quorum), a spare's at once, else the replacement's.
            full = [e["time"] for g in self.groups for e in events(self.dir, g)
                    if e["event"] == "quorum" and e["time"] > killed and e["participants"] >= self.nodes]
            row: dict[str, Any] = {"node": node, "survivor_stall_seconds": round(max(stalls), 3) if stalls else None,
                                   "back_to_full_width_seconds": round(min(full) - killed, 2) if full else None,
                                   "rejoin_seconds": round(joined["time"] - killed, 2) if joined else None,
                                   "healed": heal is not None,
                                   "read_checkpoint": any(e["event"] == "resume" for e in mine)}
            if joined and restart and "imports" in found and "joined" in found:
                agent = min(m["time"] for m in milestones(self.dir / "logs" / f"{node}.log", killed))
                row["breakdown_seconds"] = {
                    "noticed_and_restarted": round(agent - killed, 2),
                    "agent_python_and_torch": round(found["imports"] - agent, 2),
                    "rank_started_model_and_data": round(found.get("manager", found["joined"]) - found["imports"], 2),
                    "torchft_manager_and_quorum_or_heal": round(found["joined"] - found.get("manager", found["joined"]), 2),
                    "first_commit": round(joined["time"] - found["joined"], 2),
                }
                if heal is not None:
                    row["heal_seconds"] = round(heal["seconds"], 3)
            out.append(row)
        return out

    def plain_kills(self) -> list[dict[str, Any]]:
        """Each kill of the plain group: until a rank trained again (every rank restarted from the newest
        checkpoint), and the steps lost, at least (the newest `train` event before the kill against the
        checkpoint resumed: train events come every steps/200 steps, so up to that many more were lost)."""
        out = []
        for node, killed in self.kills:
            before = self.step_at(killed)
            later = sorted((e for g in self.groups for e in events(self.dir, g)
                            if e["event"] == "train" and e["time"] > killed), key=lambda e: e["time"])
            resumed = sorted((e for g in self.groups for e in events(self.dir, g)
                              if e["event"] == "resume" and e["time"] > killed), key=lambda e: e["time"])
            back = next((e for e in later if e["time"] > (resumed[0]["time"] if resumed else killed)), None)
            out.append({"node": node, "until_training_again_seconds": round(back["time"] - killed, 2) if back else None,
                        "steps_lost_at_least": max(0, before - resumed[0]["step"]) if resumed else None})
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _median(values: list[Any]) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.median(found), 3) if found else None


def bench_ft(steps: int = 5000, groups: int = 3, kill_every: float = 30.0, hidden: int = 128,
             heartbeat: float = 1.0, slowdown: float = 4.0, rounds: int = 2, keep: str | None = None) -> dict[str, Any]:
    """The six variants, `rounds` times (a round runs a job's two variants in turns: no kill first in even
    rounds, killed first in odd ones, so that a load that comes and goes on a shared machine falls on
    both), one after the other; the figures (medians over the rounds) as a JSON-ready dict.

    `slowdown`: every rank's step lasts this many times its compute (kubetrain/trainer/testhooks.py: a sleep, no CPU),
    a node with CPUs of its own. On this project's 2-core machines 3 nodes share 2 cores: unslowed, a
    lost node freed CPU for the others, and the job ran 1.5 times faster with a node killed every 8 s
    than with none."""
    if groups < 2:
        raise ValueError(f"--groups {groups}: a kill needs a survivor; at least 2")
    if kill_every <= heartbeat:
        raise ValueError(f"--kill-every {kill_every}: must exceed the heartbeat timeout ({heartbeat} s)")
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: at least 1")
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-ft-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {
            "benchmark": "ft",
            "job": {"model": f"mlp hidden {hidden}", "dataset": "digits", "batch_per_node": 32, "steps": steps,
                    "nodes": groups, "procs_per_node": 1, "backend": "gloo", "checkpoint_interval_steps": 100,
                    "heartbeat_timeout_seconds": heartbeat, "step_slowed": slowdown,
                    "train_event_every_steps": max(1, steps // 200)},
            "kill_every_seconds": kill_every,
            "rounds": rounds,
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
        }
        variants = (("fault_tolerant", True, 0), ("fault_tolerant_spare", True, 1),
                    ("restart_from_checkpoint", False, 0))
        for label, tolerant, spares in variants:
            runs: dict[str, list[dict[str, Any]]] = {"no_kill": [], "killed": []}
            for r in range(rounds):
                cases = (("no_kill", None), ("killed", kill_every))
                for case, every in cases if r % 2 == 0 else reversed(cases):
                    kind = ("ft-spare" if spares else "ft") if tolerant else "ddp"
                    name = f"bench-ft-{kind}-{case.replace('_', '-')}-{r}"
                    print(f"bench ft: {label}, {case.replace('_', ' ')}, round {r + 1} of {rounds}", file=sys.stderr,
                          flush=True)
                    variant = Variant(root, name, groups, spares, steps).start(
                        job_doc(name, steps, groups, tolerant, hidden, heartbeat, spares), slowdown)
                    try:
                        figures = variant.rate(every)
                        if every is not None:
                            figures["per_kill"] = variant.ft_kills() if tolerant else variant.plain_kills()
                        runs[case].append(figures)
                    finally:
                        variant.stop()
            result[label] = _summarise(runs, tolerant)
        result["fault_tolerant_over_restart_from_checkpoint_killed"] = round(
            result["fault_tolerant"]["killed"]["samples_per_second"]
            / result["restart_from_checkpoint"]["killed"]["samples_per_second"], 3)
        result["spare_no_kill_over_fault_tolerant_no_kill"] = round(
            result["fault_tolerant_spare"]["no_kill"]["samples_per_second"]
            / result["fault_tolerant"]["no_kill"]["samples_per_second"], 3)
        result["aim"] = {"spare_killed_over_no_kill": SPARE_AIM,
                         "met": result["fault_tolerant_spare"]["killed_over_no_kill"] >= SPARE_AIM}
        result["load_average_at_end"] = os.getloadavg()
        return result


def _summarise(runs: dict[str, list[dict[str, Any]]], tolerant: bool) -> dict[str, Any]:
    """Medians over the rounds of one job's variants, every round's figures and every kill beside them."""
    out: dict[str, Any] = {}
    for case, rounds in runs.items():
        kills = [k for r in rounds for k in r.get("per_kill", [])]
        figures: dict[str, Any] = {
            "samples_per_second": _median([r["samples_per_second"] for r in rounds]),
            "committed_steps_per_second": _median([r["committed_steps_per_second"] for r in rounds]),
            "eval_accuracy": _median([r["eval_accuracy"] for r in rounds]),
            "rounds": [{k: v for k, v in r.items() if k != "per_kill"} for r in rounds],
        }
        if case == "killed" and tolerant:
            back = [k["back_to_full_width_seconds"] for k in kills if k["back_to_full_width_seconds"] is not None]
            figures["median_back_to_full_width_seconds"] = _median(back)
            figures["max_back_to_full_width_seconds"] = max(back, default=None)
            figures["median_survivor_stall_seconds"] = _median([k["survivor_stall_seconds"] for k in kills])
            figures["max_survivor_stall_seconds"] = max((k["survivor_stall_seconds"] for k in kills
                                                        if k["survivor_stall_seconds"] is not None), default=None)
            figures["median_rejoin_seconds"] = _median([k["rejoin_seconds"] for k in kills])
            parts = [k["breakdown_seconds"] for k in kills if "breakdown_seconds" in k]
            if parts:
                figures["median_breakdown_seconds"] = {key: _median([p[key] for p in parts]) for key in parts[0]}
            figures["heals_without_a_checkpoint_read"] = sum(1 for k in kills if k["healed"] and not k["read_checkpoint"])
        elif case == "killed":
            figures["median_until_training_again_seconds"] = _median([k["until_training_again_seconds"] for k in kills])
            figures["median_steps_lost_at_least"] = _median([k["steps_lost_at_least"] for k in kills])
        if kills:
            figures["per_kill"] = kills
        out[case] = figures
    out["killed_over_no_kill"] = round(out["killed"]["samples_per_second"] / out["no_kill"]["samples_per_second"], 3)
    out["accuracy_killed_minus_no_kill"] = round(out["killed"]["eval_accuracy"] - out["no_kill"]["eval_accuracy"], 4)
    return out
