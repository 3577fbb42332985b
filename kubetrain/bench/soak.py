"""`kubetrain bench soak`: jobs of every mode on the test cluster, faults of every class at once.

Every fault class has its own test (tests/e2e, tests/operator); this runs them together, for a bounded
time, on the end-to-end cluster (a real node running our images): jobs of each kind in JOB_KINDS, and
faults drawn from a seeded schedule (`schedule`): a seed that failed is replayed by giving it again.
The driver is tests/e2e/soak.py (it needs the e2e fixture: the cluster, the images, the chart); this
module holds what is pure: the schedule, and the figures and invariants computed from what the driver
recorded (`summarize`). `kubetrain bench soak` runs the driver through pytest and prints its JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FAULTS: tuple[str, ...] = ("kill", "delete", "operator", "lighthouse", "stall", "apiserver", "volume-full")
"""The fault classes: a replica's container SIGKILLed through the node's containerd (`kill`), a replica's
pod deleted (`delete`), the acting operator's pod killed at once, its standby taking over (`operator`),
a fault-tolerant job's Lighthouse pod deleted (`lighthouse`), a chief's processes stopped (SIGSTOP) for
STALL_SECONDS, its /metrics accepting and never answering (`stall`), the API server killed and started
again with the same arguments (`apiserver`), a Single job's checkpoint volume filled to the last byte
(`volume-full`: its next checkpoint fails, the trainer exits 75 and resumes from its newest checkpoint once
the volume has room again)."""
REPLICA_FAULTS = frozenset({"kill", "delete", "lighthouse", "volume-full"})
"""What costs the job it hits one restart, no more: a replica that ended. The others cost none."""
VOLUME_FULL_SECONDS = 90.0
"""The longest a volume is held full: the trainer's next checkpoint (every 50 steps) fails well within it. The
volume gets its room back as soon as the job's restart shows in its status, or this long after the fault;
time lost is counted from then (the job trains on while its volume is full, until the checkpoint)."""
SMALL_VOLUME_MIB = 16
"""A soak Single job's checkpoint volume: a tmpfs of its own, so that filling it fills nothing else."""
JOB_KINDS: tuple[str, ...] = ("single", "ps", "ps-standby", "ddp", "ft-ddp", "fsdp-script")
STALL_SECONDS = 8.0
"""How long a stalled chief stays stopped: longer than a scrape's deadline (2 s) and its job's read
(4 s), far shorter than a progress deadline: no restart is due."""
MEAN_GAP_SECONDS = 20.0
"""The mean time between two faults (exponential gaps); a job is hit at most once per QUIET_SECONDS."""
QUIET_SECONDS = 45.0
"""A job a fault hit is not hit again for this long, so that each restart is one fault's (restarts counted
once per fault is an invariant) and time lost is measured fault by fault."""
MAX_FAULTS = 200
"""However long the soak: the schedule is bounded in count, as every load test here."""


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the soak's start
    kind: str
    pick: float  # in [0, 1): which of the eligible targets (the driver sorts them by name)


def schedule(seed: int, seconds: float, mean_gap: float = MEAN_GAP_SECONDS) -> list[Fault]:
    """The faults of a soak of `seconds`, the same for the same seed: every class once in a shuffled
    first round (a short soak still tries each), then classes at random; exponential gaps."""
    if seconds <= 0 or mean_gap <= 0:
        raise ValueError(f"a soak needs a positive duration and gap, got {seconds} s and {mean_gap} s")
    rng = random.Random(seed)
    first = list(FAULTS)
    rng.shuffle(first)
    out: list[Fault] = []
    at = 0.0
    while len(out) < MAX_FAULTS:
        at += rng.expovariate(1.0 / mean_gap)
        if at >= seconds:
            break
        kind = first[len(out)] if len(out) < len(first) else rng.choice(FAULTS)
        out.append(Fault(round(at, 3), kind, rng.random()))
    return out


@dataclass
class Injected:
    """A fault as the driver injected it (or skipped it: no eligible target)."""

    at: float
    kind: str
    job: str = ""  # "" for the control plane's faults (operator, apiserver)
    target: str = ""  # the pod, or the component
    steps: dict[str, int] = field(default_factory=dict)  # the step of each job it waits for, at injection
    recovered_after: float | None = None  # seconds until each of those jobs stepped past its step, or ended
    held_seconds: float | None = None  # volume-full: how long the volume was full (recovery counted after it)
    skipped: str = ""  # why it was not injected


@dataclass
class JobRecord:
    name: str
    kind: str
    state: str = ""
    restarts: int = 0
    checkpoints: list[int] = field(default_factory=list)  # status.lastCheckpoint.step, each change, in order
    replica_faults: int = 0
    reasons: list[str] = field(default_factory=list)  # its Events' reasons, read when its restarts are off


def summarize(seed: int, seconds: float, injected: list[Injected], jobs: list[JobRecord],
              orphans: list[str], operator_peak_mib: float, operator_limit_mib: float) -> dict[str, Any]:
    """The soak's figures and its invariants, each held or broken (with what broke it)."""
    done = [f for f in injected if not f.skipped]
    by_class: dict[str, dict[str, Any]] = {}
    for kind in FAULTS:
        mine = [f for f in done if f.kind == kind]
        lost = sorted(f.recovered_after for f in mine if f.recovered_after is not None)
        by_class[kind] = {"injected": len(mine), "skipped": sum(1 for f in injected if f.kind == kind and f.skipped),
                          "recovered": len(lost),
                          "seconds_lost_median": lost[len(lost) // 2] if lost else None,
                          "seconds_lost_max": lost[-1] if lost else None}
    invariants = {
        "every job Succeeded": [f"{j.name} ({j.kind}) ended {j.state or 'unended'}" for j in jobs if j.state != "Succeeded"],
        "no checkpoint regressed": [f"{j.name}: checkpoints {j.checkpoints}" for j in jobs
                                    if any(b < a for a, b in zip(j.checkpoints, j.checkpoints[1:]))],
        "restarts counted once per fault": [f"{j.name} ({j.kind}): {j.restarts} restarts for {j.replica_faults} faults"
                                            + (f" (its Events: {', '.join(j.reasons)})" if j.reasons else "")
                                            for j in jobs if j.restarts != j.replica_faults],
        "no orphaned child": orphans,
        "operator memory bounded": ([f"peak {operator_peak_mib:.0f} MiB, limit {operator_limit_mib:.0f} MiB"]
                                    if operator_peak_mib >= operator_limit_mib else []),
        # A fault with no job training at the time (a control-plane fault before any step) has nothing to
        # recover: it is counted injected, not measured.
        "every fault recovered": [f"{f.kind} at {f.at:.0f} s on {f.job or f.target}" for f in done
                                  if f.recovered_after is None and f.steps],
    }
    return {
        "seed": seed, "seconds": seconds,
        "jobs": {kind: sum(1 for j in jobs if j.kind == kind) for kind in JOB_KINDS},
        "faults": by_class,
        "operator_peak_mib": round(operator_peak_mib, 1),
        "invariants": {name: {"held": not broken, "broken": broken} for name, broken in invariants.items()},
        "held": all(not broken for broken in invariants.values()),
        "injected": [asdict(f) for f in injected],
    }


def bench_soak(minutes: float, seed: int | None, keep: bool = False) -> dict[str, Any]:
    """Run the driver (tests/e2e/test_e2e_soak.py) through pytest on the e2e cluster, and its JSON."""
    root = Path(__file__).resolve().parents[2]
    test = root / "tests" / "e2e" / "test_e2e_soak.py"
    if not test.is_file():
        raise ValueError(f"kubetrain bench soak runs from a checkout of kubetrain: {test} is missing")
    if minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {minutes}")
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="kubetrain-soak-") as tmp:
        out = Path(tmp) / "soak.json"
        env = dict(os.environ, KUBETRAIN_SOAK_SECONDS=str(minutes * 60), KUBETRAIN_SOAK_SEED=str(seed),
                   KUBETRAIN_SOAK_OUT=str(out), **({"KUBETRAIN_E2E_KEEP": "1"} if keep else {}))
        print(f"kubetrain bench soak: seed {seed}, {minutes:g} minutes (replay with --seed {seed})", file=sys.stderr)
        # No per-test timeout (the suite's is 900 s): the soak runs for its minutes, then drains.
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "timeout=0", "-s", "-q",
                               str(test)],
                              cwd=root, env=env, check=False)
        if not out.is_file():
            raise SystemExit(f"kubetrain bench soak: the driver wrote no result (pytest exited {done.returncode})")
        result = json.loads(out.read_text())
    result["pytest_exit"] = done.returncode
    return result
