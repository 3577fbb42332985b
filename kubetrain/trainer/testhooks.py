"""The test and benchmark hooks of the training loops, in one module: each is off unless a variable that only
tests and benchmarks set says otherwise, and none is a spec field (a job never wants them).

| variable (kubetrain.shared.launch) | set by | what the loops do |
|---|---|---|
| `KUBETRAIN_BENCH_SLOWDOWN` (`SLOWDOWN_VAR`) | `kubetrain bench modes --case straggler`, slow tests | `Slowdown`: a replica sleeps (factor - 1) x its step's compute |
| `KUBETRAIN_TEST_FT_HOLD` (`FT_HOLD_VAR`) | fault-tolerant tests | `Hold`: no group commits step STEP before GROUPS groups take part |
| `KUBETRAIN_TEST_FT_JOIN_DELAY` (`FT_JOIN_DELAY_VAR`) | fault-tolerant tests | `join_delay`: a group waits before it makes its torchft Manager |
| `KUBETRAIN_TEST_FT_COUNT` (`FT_COUNT_VAR`) | fault-tolerant tests | `counts_samples`: ranks count how often each sample was trained |

The local driver passes its own environment to every replica, so setting one around `kubetrain run` is
enough. Unset, each does nothing; a bad value stops the replica with exit 2 and a message naming the
variable. (`KUBETRAIN_FAULT`, the kills of `kubetrain run --fault`, is a documented feature of the local
driver, read by kubetrain.trainer.context.)

The straggler: `KUBETRAIN_BENCH_SLOWDOWN=worker-1:3` makes the replica `worker-1` sleep
(3 - 1) x its own compute time after each step's compute, so that its
compute takes about 3 times as long as it would. Compute time is the CPU time of the
training thread (time.thread_time) between `begin()` and `after()`: neither
waiting for peers (a DDP rank's all-reduce inside backward) nor other
processes taking the cores (a loaded 2-core machine makes a step's wall time
several times its CPU time) is multiplied, so the factor is the replica's
own and the same in every mode. Several replicas:
`worker-1:3,worker-0:1.5`. DDP ranks are named by global rank (`ddp-1`), as
in their metrics. On a GPU the CPU time misses the kernels: a CPU knob.
What "compute" covers: Single the optimizer step (forward, backward,
update); a PS worker its batch's forward and backward (not the pull, not the
push); a DDP rank its forward, backward and update (the all-reduce runs in
gloo's threads, not counted).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kubetrain.shared.launch import FT_COUNT_VAR, FT_HOLD_VAR, FT_JOIN_DELAY_VAR, SLOWDOWN_VAR

from .errors import ConfigError

log = logging.getLogger(__name__)

# The largest factor taken. A replica 100x slower than its peers is no
# straggler but a dead replica to every mode: a Sync shard drops it after
# syncTimeoutSeconds (30 s by default, reached by 0.3 s steps), DDP's
# collectives time out at progressDeadlineSeconds. Beyond it the value is
# refused (exit 2) rather than turned into a benchmark of timeouts.
MAX_FACTOR = 100.0
_ENTRY = re.compile(r"([a-z]+-[0-9]+):([0-9]+(?:\.[0-9]*)?)")


def parse_slowdown(text: str) -> dict[str, float]:
    """`REPLICA:FACTOR[,REPLICA:FACTOR...]` -> {replica: factor}; ConfigError naming the variable when malformed."""
    factors: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _ENTRY.fullmatch(part)
        if match is None:
            raise ConfigError(
                f"{SLOWDOWN_VAR}: expected REPLICA:FACTOR[,REPLICA:FACTOR...] such as 'worker-1:3', got {text!r} "
                f"(the part {part!r})"
            )
        replica, factor = match.group(1), float(match.group(2))
        if not 1.0 <= factor <= MAX_FACTOR:
            raise ConfigError(f"{SLOWDOWN_VAR}: the factor of {replica} must be between 1 and {MAX_FACTOR:g}, "
                              f"got {match.group(2)} in {text!r}")
        if replica in factors:
            raise ConfigError(f"{SLOWDOWN_VAR}: {replica} is named twice in {text!r}")
        factors[replica] = factor
    return factors


class Slowdown:
    """The slowdown of one replica; factor 1 (the default) does nothing."""

    def __init__(self, factor: float = 1.0):
        self.factor = factor
        self._started = 0.0

    @classmethod
    def for_replica(cls, replica: str, environ: Mapping[str, str] | None = None) -> "Slowdown":
        env = os.environ if environ is None else environ
        factor = parse_slowdown(env.get(SLOWDOWN_VAR, "")).get(replica, 1.0)
        if factor > 1.0:
            log.warning("%s: slowed %gx for a benchmark (%s)", replica, factor, SLOWDOWN_VAR)
        return cls(factor)

    def begin(self) -> None:
        """A step's compute starts (in the training thread)."""
        self._started = time.thread_time()

    def after(self) -> None:
        """The step's compute ended: sleep (factor - 1) times its CPU time since `begin`."""
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * max(0.0, time.thread_time() - self._started))


@dataclass(frozen=True)
class Hold:
    """KUBETRAIN_TEST_FT_HOLD (kubetrain/shared/launch.py), a test knob: the group does not commit `step` until
    `groups` replica groups take part in its quorum; it asks for a quorum again every HOLD_POLL_SECONDS.

    A test that kills a group holds the job's last step for every group: the survivors train on until
    the replacement has joined (an interpreter, torch and the Manager: 5-40 s on a loaded 2-core machine)
    instead of running enough steps for its slowest start, and a replacement that came too late (after the
    survivors ended) cannot happen. A group holds at most quorumTimeoutSeconds, the longest a group waits
    for a quorum, then commits with those present (a warning): a replacement that never comes costs the
    test that wait, not its timeout."""

    step: int
    groups: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Hold | None":
        raw = env.get(FT_HOLD_VAR, "")
        if not raw:
            return None
        step, _, groups = raw.partition(":")
        if not (step.isdigit() and groups.isdigit() and int(step) > 0 and int(groups) > 0):
            raise ConfigError(f"{FT_HOLD_VAR}: expected STEP:GROUPS (two positive integers) such as '600:3', "
                              f"got {raw!r}")
        return cls(int(step), int(groups))


def join_delay(env: Mapping[str, str], group: int) -> float:
    """KUBETRAIN_TEST_FT_JOIN_DELAY (kubetrain/shared/launch.py), a test knob: the seconds this replica group waits
    before it makes its Manager (0 when the variable does not name it)."""
    raw = env.get(FT_JOIN_DELAY_VAR, "")
    for item in filter(None, raw.split(",")):
        name, _, seconds = item.partition(":")
        try:
            delay = float(seconds)
        except ValueError:
            delay = -1.0
        if not name.startswith("ddp-") or not 0 <= delay < math.inf:
            raise ConfigError(f"{FT_JOIN_DELAY_VAR}: expected GROUP:SECONDS,... such as 'ddp-1:3,ddp-2:20', "
                              f"got {raw!r}")
        if name == f"ddp-{group}":
            return delay
    return 0.0


def counts_samples(env: Mapping[str, str]) -> bool:
    """KUBETRAIN_TEST_FT_COUNT (kubetrain/shared/launch.py), a test knob: whether a fault-tolerant rank counts how
    often the committed steps of the epoch in progress trained each sample (its events carry the counts, which
    tests/local/test_fault_tolerant_runs.py checks: no sample lost or repeated)."""
    return bool(env.get(FT_COUNT_VAR))
