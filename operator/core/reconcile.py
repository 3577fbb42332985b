"""One reconciliation of a TrainingJob: observation in, actions and the new status out.

Pure: the job, what the operator observed of its pods (and, for DDP, of its
StatefulSet's pods), the progress read from the chief's metrics, the old
status and the time go in; the objects to create, the pods to delete, the
Events to record, the new status and when to look again come out. The kopf
handlers only gather the observation and carry out the actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..api import TrainingJob
from ..api.spec import MAX_REPORTED_METRICS
from . import policy
from .children import Settings, children, pod_name
from .plan import chief, replica_names
from .status import TERMINAL, Observed, conditions

PS_DRAIN_SECONDS = 120.0  # shards exit by themselves once the workers finished
IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}


@dataclass(frozen=True)
class PodObservation:
    """What matters of one pod (or one StatefulSet pod)."""

    replica: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    exit_code: int | None = None  # of the trainer container, once terminated
    reason: str = ""  # pod.status.reason (Evicted, ...)
    waiting_reason: str = ""  # ImagePullBackOff, CrashLoopBackOff, ...
    waiting_message: str = ""
    terminating: bool = False
    restart_count: int = 0  # StatefulSet pods restart in place
    last_exit_code: int | None = None  # lastState.terminated.exitCode (StatefulSet pods)
    node: str = ""
    ip: str = ""
    uid: str = ""  # a StatefulSet's replacement pod keeps the name, not the uid
    final: Mapping[str, Any] | None = None  # the trainer's termination message: its final results


@dataclass(frozen=True)
class Progress:
    """Read from the chief's /metrics by the operator's timer."""

    step: int
    total_steps: int | None = None
    loss: float | None = None
    eval_accuracy: float | None = None
    samples_per_second: float | None = None
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None  # unix seconds
    metrics: Mapping[str, float] | None = None  # what a script reported by name (kubetrain.report)


@dataclass
class Actions:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)  # pod names, deleted gracefully
    scale_statefulset: int | None = None
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    status: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(s: str | None) -> float | None:
    if not s:
        return None
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _counts(job: TrainingJob, pods: dict[str, PodObservation]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for role, index in replica_names(job):
        c = out.setdefault(role, {"active": 0, "succeeded": 0, "failed": 0})
        p = pods.get(f"{role}-{index}")
        if p is None:
            continue
        if _succeeded(p, role == "ddp"):
            c["succeeded"] += 1
        elif p.phase == "Failed":
            c["failed"] += 1
        elif p.phase in ("Pending", "Running") and not p.terminating:
            c["active"] += 1
    return out


def _failure(p: PodObservation) -> policy.Failure | None:
    """A replica that stopped and must be dealt with; None while it is fine."""
    if p.terminating:
        return None
    if p.phase == "Failed":
        if p.reason == "Evicted":
            return policy.Failure(p.replica, reason="Evicted")
        return policy.Failure(p.replica, exit_code=p.exit_code if p.exit_code is not None else 1)
    return None


def reconcile(
    job: TrainingJob,
    uid: str,
    token: str,
    pods: dict[str, PodObservation],
    old_status: dict[str, Any],
    now: float,
    progress: Progress | None = None,
    settings: Settings = Settings(),
    pvc_pending: list[str] | None = None,
    existing: set[tuple[str, str]] | None = None,
) -> Actions:
    """`existing` names the (kind, name) of non-pod children known to exist; they
    are not created again (None: create all, the I/O layer ignores conflicts)."""
    spec = job.spec
    act = Actions()
    st = dict(old_status)
    st.setdefault("restarts", 0)
    st.setdefault("restartsWithoutProgress", 0)
    state_before = st.get("state", "Created")
    generation = job.metadata.generation
    observed: Observed | None = None
    names = [f"{r}-{i}" for r, i in replica_names(job)]
    is_ddp = spec.mode == "DDP"

    if progress is not None:
        st["progress"] = {
            k: v
            for k, v in {
                "step": progress.step,
                "totalSteps": progress.total_steps,
                "loss": progress.loss,
                "evalAccuracy": progress.eval_accuracy,
                "samplesPerSecond": progress.samples_per_second,
                "metrics": dict(progress.metrics) if progress.metrics else None,
                "updateTime": iso(now),
            }.items()
            if v is not None
        }
        if progress.step > st.get("lastStep", -1):
            st["lastStep"] = progress.step
            st["lastStepTime"] = iso(now)
        if progress.checkpoint_step:
            st["lastCheckpoint"] = {"step": progress.checkpoint_step, "time": iso(progress.checkpoint_time or now)}

    def finish(state: str, reason: str, message: str) -> None:
        nonlocal observed
        observed = Observed(state, reason, message)
        st["state"] = state
        st["completionTime"] = st.get("completionTime") or iso(now)
        clean = spec.run_policy.clean_pod_policy
        doomed = [
            n for n, p in pods.items()
            if clean == "All" or (clean == "Running" and p.phase in ("Pending", "Running"))
        ]  # fmt: skip
        if is_ddp:
            if clean != "None":
                act.scale_statefulset = 0
        else:
            act.delete_pods += [pod_name(job, n) for n in doomed]
        act.events.append(("Normal" if state == "Succeeded" else "Warning", reason, message))
        if state == "Succeeded":
            _final_progress(st, job, pods, now)

    # -- already finished: only the TTL is left --------------------------------
    if state_before in TERMINAL:
        ttl = spec.run_policy.ttl_seconds_after_finished
        done = parse_iso(st.get("completionTime"))
        if ttl is not None and done is not None:
            if now - done >= ttl:
                act.delete_job = True
            else:
                act.requeue_after = ttl - (now - done)
        act.status = st
        return act

    # -- suspended -------------------------------------------------------------
    if spec.run_policy.suspend:
        live = [n for n, p in pods.items() if p.phase in ("Pending", "Running") and not p.terminating]
        if is_ddp:
            act.scale_statefulset = 0
        else:
            act.delete_pods += [pod_name(job, n) for n in live]
        if state_before != "Suspended":
            act.events.append(("Normal", "Suspended", "The job is suspended; its pods stop after a checkpoint."))
        observed = Observed("Suspended", "Suspended", "The job is suspended; set spec.runPolicy.suspend to false to resume.")
        st["state"] = "Suspended"
        st.pop("pendingRestarts", None)
        st.pop("ddpPodUids", None)  # the pods that come back on resume are new, not replacements
        _finish_status(st, job, pods, observed, now, generation)
        act.status = st
        return act

    if st.get("startTime") is None:
        st["startTime"] = iso(now)
    if state_before == "Suspended":
        st["lastStepTime"] = iso(now)  # the progress clock restarts with the pods
        act.events.append(("Normal", "Resumed", "The job resumes from its newest checkpoint."))

    # -- deadline ------------------------------------------------------------------
    deadline = spec.run_policy.active_deadline_seconds
    started = parse_iso(st.get("startTime")) or now
    if deadline is not None and now - started >= deadline:
        finish("Failed", "DeadlineExceeded", f"The job ran longer than activeDeadlineSeconds ({deadline} s).")
        _finish_status(st, job, pods, observed, now, generation)
        act.status = st
        return act

    # -- failures and restarts -------------------------------------------------------
    pending: dict[str, str] = dict(st.get("pendingRestarts") or {})
    counters = policy.Counters(st["restarts"], st["restartsWithoutProgress"])
    checkpoint_now = (st.get("lastCheckpoint") or {}).get("step", 0)
    failures: list[policy.Failure] = []
    for n in names:
        p = pods.get(n)
        if n in pending:
            continue
        if p is None:
            if state_before in ("Running", "Restarting") and not is_ddp:
                failures.append(policy.Failure(n, reason="Deleted"))
            continue
        if is_ddp and p.uid:
            uids = dict(st.get("ddpPodUids") or {})
            known = uids.get(n)
            uids[n] = p.uid
            st["ddpPodUids"] = uids
            if known and known != p.uid and state_before in ("Running", "Restarting"):
                # The StatefulSet replaced a rank's pod (deleted, evicted, its node
                # gone) before this round saw it missing: count it once.
                st["ddpRestartCounts"] = dict(st.get("ddpRestartCounts") or {}, **{n: p.restart_count})
                failures.append(policy.Failure(n, reason="Deleted"))
                continue
        f = _failure(p)
        if f is not None:
            failures.append(f)
        elif is_ddp and p.restart_count > int((st.get("ddpRestartCounts") or {}).get(n, 0)):
            # A rank's container restarted in place (torchrun gave up): count it.
            counts = dict(st.get("ddpRestartCounts") or {})
            counts[n] = p.restart_count
            st["ddpRestartCounts"] = counts
            if p.last_exit_code not in (0, None):
                failures.append(policy.Failure(n, exit_code=p.last_exit_code))
    # Hang: no new step for progressDeadlineSeconds while replicas run. The
    # clock starts with the first step the operator read from the metrics, so
    # a job whose metrics cannot be read is never taken for hung.
    last_step_time = parse_iso(st.get("lastStepTime")) or started
    limit = spec.run_policy.progress_deadline_seconds
    watched = "lastStep" in st
    if not failures and watched and state_before in ("Running", "Restarting") and now - last_step_time >= limit:
        failures.append(policy.Failure(chief(job), reason="Hung"))
        st["lastStepTime"] = iso(now)
    for f in failures:
        progressed = checkpoint_now > int(st.get("checkpointAtLastRestart", 0))
        decision, counters = policy.decide(spec, f, counters, progressed)
        if decision.action == "fail":
            finish("Failed", decision.reason, decision.message)
            break
        st["checkpointAtLastRestart"] = checkpoint_now
        act.events.append(("Warning", decision.reason, decision.message))
        observed = Observed("Restarting", decision.reason, decision.message)
        if not is_ddp:
            pending[f.replica] = iso(now + decision.delay_seconds)
            if f.replica in pods and f.reason != "Deleted":
                act.delete_pods.append(pod_name(job, f.replica))
        elif f.reason == "Hung":
            act.delete_pods.append(pod_name(job, f.replica))
            # Its replacement is this restart, not another one.
            st["ddpPodUids"] = {k: v for k, v in (st.get("ddpPodUids") or {}).items() if k != f.replica}
    st["restarts"], st["restartsWithoutProgress"] = counters.restarts, counters.restarts_without_progress
    if observed is not None and observed.state == "Failed":
        st.pop("pendingRestarts", None)
        _finish_status(st, job, pods, observed, now, generation)
        act.status = st
        return act

    # -- create what is missing (a restarted replica after its backoff) ------------------
    for obj in children(job, uid, token, settings):
        if existing is not None and (obj["kind"], obj["metadata"]["name"]) in existing:
            continue
        if obj["kind"] == "Pod":
            replica = obj["metadata"]["name"][len(job.name) + 1 :]
            if replica in pods:
                continue  # running, finished, or a failed one being deleted this round
            due = parse_iso(pending.get(replica))
            if due is not None and due > now:
                continue
            pending.pop(replica, None)
        act.create.append(obj)
    if pending:
        st["pendingRestarts"] = pending
        soonest = min(parse_iso(t) or now for t in pending.values())
        act.requeue_after = max(0.1, soonest - now)
    else:
        st.pop("pendingRestarts", None)

    # -- success ---------------------------------------------------------------------------
    counts = _counts(job, pods)
    phases = {n: ("Succeeded" if _succeeded(pods.get(n), is_ddp) else "Running") for n in names}
    if observed is None and policy.job_outcome(phases) == "Succeeded":
        finish("Succeeded", "Completed", "Every replica finished.")
    elif observed is None and spec.mode == "ParameterServer" and policy.workers_done(phases):
        # The shards write a final checkpoint and exit when the coordinator
        # says so; one that does not is stopped gracefully after a while.
        st.setdefault("workersDoneTime", iso(now))
        if now - (parse_iso(st["workersDoneTime"]) or now) > PS_DRAIN_SECONDS:
            act.delete_pods += [pod_name(job, n) for n in names if n.startswith("ps-") and n in pods]
        act.requeue_after = 5.0

    if observed is None:
        problem = _problem(pods, pvc_pending or [])
        if problem:
            observed = Observed("Created", problem[0], problem[1])
            act.events.append(("Warning", problem[0], problem[1]))
        elif any(p.phase == "Running" for p in pods.values()):
            observed = Observed("Running", "Running", "The job's replicas are running.")
        elif state_before in ("Running", "Restarting"):
            observed = Observed(state_before, "Restarting" if state_before == "Restarting" else "Running", "Replicas are being recreated.")
        else:
            observed = Observed("Created", "Created", "The job's objects are created; pods are starting.")
    st["state"] = observed.state
    _finish_status(st, job, pods, observed, now, generation)
    if st["state"] not in TERMINAL:
        act.requeue_after = min(act.requeue_after or 10.0, 10.0)
    act.status = st
    return act


def _finite(value: Any) -> bool:
    """A number the status can hold (JSON has no NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _final_progress(st: dict[str, Any], job: TrainingJob, pods: dict[str, PodObservation], now: float) -> None:
    """At success, the chief's final results (its termination message) complete the progress
    that the last read of its metrics, up to a few seconds old, left behind."""
    head = pods.get(chief(job))
    final = head.final if head is not None else None
    if not final:
        return
    progress = dict(st.get("progress") or {})
    step = final.get("global_step", final.get("steps"))
    for key, value in (("step", step), ("loss", final.get("final_train_loss")),
                       ("evalAccuracy", final.get("eval_accuracy"))):
        if _finite(value):
            progress[key] = value
    # A script's last reported values (kubetrain.report), often reported just before it exits.
    reported = final.get("metrics")
    if isinstance(reported, dict):
        merged = {**(progress.get("metrics") or {}),
                  **{str(k): v for k, v in reported.items() if _finite(v)}}
        progress["metrics"] = dict(list(merged.items())[:MAX_REPORTED_METRICS])
    if isinstance(step, int):
        progress.setdefault("totalSteps", step)
        progress["updateTime"] = iso(now)
        st["progress"] = progress
    # The newest checkpoint: the chief's own (Single, DDP) or the first shard's (ParameterServer).
    holder = pods.get("ps-0") if job.spec.mode == "ParameterServer" else head
    ckpt = (holder.final or {}) if holder is not None else {}
    if isinstance(ckpt.get("checkpoint_step"), int) and ckpt["checkpoint_step"] > 0:
        when = ckpt.get("checkpoint_time")
        st["lastCheckpoint"] = {"step": ckpt["checkpoint_step"],
                                "time": iso(when) if isinstance(when, (int, float)) else iso(now)}


def _succeeded(p: PodObservation | None, is_ddp: bool) -> bool:
    if p is None:
        return False
    if p.phase == "Succeeded":
        return True
    # A StatefulSet restarts even a container that exited 0; its resumed
    # trainer finds the final checkpoint and exits 0 again.
    return is_ddp and (p.exit_code == 0 or (p.last_exit_code == 0 and p.phase != "Failed"))


def _problem(pods: dict[str, PodObservation], pvc_pending: list[str]) -> tuple[str, str] | None:
    for p in pods.values():
        if p.waiting_reason in IMAGE_PULL_REASONS:
            return "ImagePullFailed", f"{p.replica} cannot pull its image ({p.waiting_reason}): {p.waiting_message}".rstrip(": ")
    if pvc_pending:
        return "VolumePending", f"PersistentVolumeClaim {', '.join(pvc_pending)} is Pending: check the StorageClass."
    return None


def _finish_status(
    st: dict[str, Any], job: TrainingJob, pods: dict[str, PodObservation], observed: Observed | None, now: float, generation: int
) -> None:
    st["observedGeneration"] = generation
    st["workers"] = job.spec.world_size
    st["replicaStatuses"] = _counts(job, pods)
    if observed is not None:
        st["conditions"] = conditions(st.get("conditions"), observed, iso(now), generation)
