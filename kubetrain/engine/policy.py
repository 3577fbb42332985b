"""Restart and success policies: observed replicas in, decisions out.

Pure and shared by the local backend and the operator, so a job behaves the
same on a laptop and in a cluster.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from kubetrain.shared.exitcodes import EXIT_TRANSIENT, PERMANENT_REASONS, killed_by, shell_code, signal_name

from kubetrain.api import Spec

BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 60.0


@dataclass(frozen=True)
class Failure:
    """Why a replica stopped running."""

    replica: str
    exit_code: int | None = None  # None: no exit code (evicted, deleted, hung)
    reason: str = ""  # Evicted | Deleted | Hung | NodeLost | ... when exit_code is None
    message: str = ""  # kubetrain's own account of the error (the pretrained model's check), when there is one

    def describe(self) -> str:
        if self.exit_code is None:
            return {
                "Hung": f"{self.replica} made no progress and was stopped",
                "Evicted": f"{self.replica} was evicted",
                "Deleted": f"{self.replica} was deleted",
                "NodeLost": f"{self.replica}'s node stopped answering (NotReady or unreachable)",
            }.get(self.reason, f"{self.replica} stopped ({self.reason})")
        signum = killed_by(self.exit_code)
        if signum is not None:
            return f"{self.replica} was killed by {signal_name(signum)}"
        said = f": {self.message}" if self.message else ""
        return f"{self.replica} exited with code {self.exit_code}{said}"

    @property
    def code(self) -> int | None:
        """Exit code in the shell convention (128+N for signal N)."""
        return None if self.exit_code is None else shell_code(self.exit_code)

    @property
    def restart_reason(self) -> str:
        """One CamelCase word for conditions and Events."""
        if self.exit_code is None:
            return self.reason or "Unknown"
        code = self.code
        assert code is not None
        signum = killed_by(code)
        if signum is not None:
            return "Killed" if signum == signal.SIGKILL else "Signaled"
        if code == EXIT_TRANSIENT:
            return "TransientError"
        return PERMANENT_REASONS.get(code, "Error")


@dataclass(frozen=True)
class Counters:
    restarts: int = 0
    restarts_without_progress: int = 0


@dataclass(frozen=True)
class Decision:
    action: Literal["restart", "fail"]
    reason: str  # CamelCase
    message: str
    delay_seconds: float = 0.0


def retryable(policy: str, failure: Failure) -> bool:
    if policy == "Never":
        return False
    code = failure.code
    if code is None:  # evicted, deleted, hung: the process did not decide
        return True
    if code in PERMANENT_REASONS:
        return False
    if policy == "ExitCode":
        return code == EXIT_TRANSIENT or killed_by(code) is not None
    return True


def backoff(restarts: int) -> float:
    """Delay before restart number `restarts` (1-based): at once, then 1 s, 2 s, 4 s, ... capped.

    The first failure is most often a one-off (a node lost, a kill): it is
    replaced at once. A job that keeps failing waits longer each time.
    """
    if restarts <= 1:
        return 0.0
    return min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2.0 ** (restarts - 2))


def decide(spec: Spec, failure: Failure, counters: Counters, progressed: bool) -> tuple[Decision, Counters]:
    """What to do about a failed replica, and the counters after it.

    `progressed` says whether a new checkpoint appeared since the last restart:
    a restart that saw none counts against maxRestartsWithoutProgress, so a job
    that crashes before every checkpoint stops burning its budget.
    """
    rp = spec.restart_policy
    what = failure.describe()
    if not retryable(rp.policy, failure):
        why = "restartPolicy is Never" if rp.policy == "Never" else f"exit code {failure.code} is permanent"
        if rp.policy == "ExitCode" and failure.code not in PERMANENT_REASONS:
            why = f"restartPolicy ExitCode retries only 75 and signals, got {failure.code}"
        return Decision("fail", failure.restart_reason, f"{what}; not restarted: {why}."), counters
    if counters.restarts >= rp.backoff_limit:
        return (
            Decision("fail", "BackoffLimitExceeded", f"{what}; backoffLimit {rp.backoff_limit} reached."),
            counters,
        )
    if failure.reason == "NodeLost":
        # The node failed, not the job: one lost node takes every replica on it at once, and
        # those restarts must not use up maxRestartsWithoutProgress (a crash loop's budget).
        without = counters.restarts_without_progress
    else:
        without = 0 if progressed else counters.restarts_without_progress + 1
    if without > rp.max_restarts_without_progress:
        return (
            Decision(
                "fail",
                "NoProgress",
                f"{what}; {counters.restarts_without_progress} restarts in a row saw no new checkpoint "
                f"(maxRestartsWithoutProgress {rp.max_restarts_without_progress}).",
            ),
            counters,
        )
    after = Counters(restarts=counters.restarts + 1, restarts_without_progress=without)
    group = _replica_group_lost(spec, failure)
    if group is not None:
        # The other groups train on: the lost one is replaced at once while the job progresses, and
        # backs off only while its restarts see no new checkpoint (a group that cannot start).
        reason, how = group
        return (
            Decision("restart", reason, f"{what}; {how}; restart {after.restarts} of {rp.backoff_limit}.",
                     delay_seconds=backoff(without + 1)),
            after,
        )
    return (
        Decision(
            "restart",
            failure.restart_reason,
            f"{what}; restart {after.restarts} of {rp.backoff_limit}.",
            delay_seconds=backoff(after.restarts),
        ),
        after,
    )


def _replica_group_lost(spec: Spec, failure: Failure) -> tuple[str, str] | None:
    """(reason, what the job does) for a fault-tolerant DDP job's replica group or Lighthouse that
    failed (and is retried); None for every other failure."""
    if not spec.fault_tolerant:
        return None
    if failure.replica.startswith("ddp-"):
        return ("ReplicaGroupLost", "the other replica groups train on without it, and its replacement copies "
                                    "the model from one of them")
    if failure.replica.startswith("lighthouse-"):
        return ("LighthouseLost", "the replica groups wait for its replacement and form a quorum again")
    return None


ReplicaPhase = Literal["Pending", "Running", "Succeeded", "Failed"]


def job_outcome(phases: dict[str, ReplicaPhase]) -> Literal["Running", "Succeeded"]:
    """Succeeded when the replicas that finish a job have finished.

    Single: single-0. DDP: every node. ParameterServer: every worker and every
    shard (a shard exits 0 after the workers finished and it wrote its final
    checkpoint, so none is left running), and every standby worker (ps-0 tells a
    waiting standby when the workers have finished, and it exits 0).
    """
    if phases and all(p == "Succeeded" for p in phases.values()):
        return "Succeeded"
    return "Running"


def shards_done_with_standbys(phases: dict[str, ReplicaPhase]) -> bool:
    """A ParameterServer job with standby workers has finished training when its shards have: a shard
    exits 0 only once every worker's place finished, whichever process held it (a standby may have
    taken a killed worker's place, and that worker's replacement then waits as a standby)."""
    shards = [p for name, p in phases.items() if name.startswith("ps-")]
    standbys = any(name.startswith("standby-") for name in phases)
    return standbys and bool(shards) and all(p == "Succeeded" for p in shards)


def workers_done(phases: dict[str, ReplicaPhase]) -> bool:
    workers = [p for name, p in phases.items() if name.startswith("worker-")]
    return bool(workers) and all(p == "Succeeded" for p in workers)
