"""A benchmark knob: make one replica a straggler, slower than the others by a fixed factor.

`KUBETRAIN_BENCH_SLOWDOWN=worker-1:3` makes the replica `worker-1` sleep
(3 - 1) x its own compute time after each step's compute, so that its
compute takes about 3 times as long as it would. Compute time is the CPU time of the
training thread (time.thread_time) between `begin()` and `after()`: neither
waiting for peers (a DDP rank's all-reduce inside backward) nor other
processes taking the cores (a loaded 2-core machine makes a step's wall time
several times its CPU time) is multiplied, so the factor is the replica's
own and the same in every mode. Several replicas:
`worker-1:3,worker-0:1.5`. DDP ranks are named by global rank (`ddp-1`), as
in their metrics. On a GPU the CPU time misses the kernels: a CPU knob.

Only benchmarks set it (`kubetrain bench modes --case straggler`); it is no
spec field, because a job never wants to be slowed. The local backend passes
its own environment to every replica, so setting it around `kubetrain run`
is enough. Unset: no effect.

What "compute" covers: Single the optimizer step (forward, backward,
update); a PS worker its batch's forward and backward (not the pull, not the
push); a DDP rank its forward, backward and update (the all-reduce runs in
gloo's threads, not counted). A bad value stops the replica with exit 2
and a message naming the variable.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping

from kubetrain_contract.launch import SLOWDOWN_VAR

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
