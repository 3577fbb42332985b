"""The TrainingJob's status, typed: what users read (`JobStatus`) and what the engine remembers (`JobMemory`).

Described once, like the spec: the CRD's status schema is generated from these
classes (`crd.status_schema`), the operator reads the API's copy with
`read_status` and writes `to_dict(status)`, and the local backend keeps the same
object in its run directory. Everything the engine needs between two rounds is
a declared field of `JobMemory` (`status.memory`), so the API server keeps it
and an operator that restarts, or a standby that takes over, continues where
the last one stopped: restart counts, backoff timers, the hang clock, the
deadline clock and the identities of the DDP pods.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import schema
from .schema import field


@dataclass
class Condition:
    """One condition of the job (Created, Running, Restarting, Suspended, Succeeded, Failed)."""

    type: str = field("Created, Running, Restarting, Suspended, Succeeded or Failed.")
    status: str = field("True or False.")
    reason: str = field("One CamelCase word: why.")
    message: str = field("A sentence a user can act on.")
    last_transition_time: str = field("When the status last changed (RFC 3339).")
    observed_generation: int = field("The spec generation this condition was computed for.", 0)


@dataclass
class ReplicaCounts:
    """Replicas of one role by what they are doing."""

    active: int = field("Pending or running.", 0)
    succeeded: int = field("Finished.", 0)
    failed: int = field("Failed and not (yet) replaced.", 0)


@dataclass
class LastCheckpoint:
    """The newest durable checkpoint."""

    step: int = field("Its training step.", 0)
    time: str | None = field("When it was written (RFC 3339).", None)


@dataclass
class Progress:
    """Training progress, read from the chief's metrics (and at the end its final results)."""

    step: int = field("The newest training step.", 0)
    total_steps: int | None = field("Steps the job will run.", None)
    loss: float | None = field("The newest training loss.", None)
    eval_accuracy: float | None = field("The newest evaluation accuracy.", None)
    eval_loss: float | None = field("The newest evaluation loss.", None)
    eval_perplexity: float | None = field("model causal-lm: the newest evaluation perplexity, exp(evalLoss).", None)
    samples_per_second: float | None = field("Training throughput.", None)
    metrics: dict[str, float] | None = field(
        "What a script reported with kubetrain.report(step, name=value), by name.", None
    )
    eta_seconds: int | None = field(
        "Seconds until totalSteps at the recent steps per second (a moving average over about a minute); "
        "0 once the job succeeded.", None)
    update_time: str | None = field("When this was read (RFC 3339).", None)


@dataclass
class Quorum:
    """A fault-tolerant DDP job's quorum (spec.ddp.faultTolerance): the replica groups training now."""

    participants: int = field("Replica groups taking part in the current step.", 0)
    groups: int = field("Replica groups the job has (its DDP nodes).", 0)
    update_time: str | None = field("When this was read (RFC 3339).", None)


@dataclass
class TrainerImage:
    """The trainer a job's replicas run, recorded by the engine when the job first starts: one for the job's whole
    life, so that an upgraded operator keeps starting the job's pods with the trainer its other pods run."""

    image: str = field(
        "The image of every replica the operator starts for the job while spec.image is unset: the operator's "
        "trainer image when the job first started (or, for a job an older operator started, the image of its "
        "running pods). Empty for a local run, whose processes run the installed kubetrain.", "")
    version: str = field(
        "kubetrain's version in that image (the tag of kubetrain's trainer image); empty when the image does not "
        "say (a user's own image).", "")


@dataclass
class JobMemory:
    """What the engine remembers between rounds. Internal: read by the operator, not by users."""

    checkpoint_at_last_restart: int = field("The newest checkpoint step when the last restart was decided.", 0)
    pending_restarts: dict[str, float] = field(
        "Replicas waiting for their restart backoff: replica -> when it is due (unix seconds).", default_factory=dict
    )
    last_step: int | None = field("The newest step seen; None before the first.", None)
    last_step_time: float | None = field("When the step last advanced (unix seconds): the hang clock.", None)
    identities: dict[str, str] = field(
        "The incarnation of each DDP replica last seen (a pod uid): a new one nobody asked for is a restart.",
        default_factory=dict,
    )
    in_place_restarts: dict[str, int] = field(
        "Restarts of each DDP replica's container in place already counted.", default_factory=dict
    )
    group_restart: list[str] = field(
        "Plain DDP: the ranks of the group restart counted last, the counted one first, until the job steps "
        "past groupRestartStep. torchrun on every node ends when the rendezvous host's node does: those ends "
        "are that one restart, counted once.", default_factory=list
    )
    group_restart_step: int | None = field(
        "Plain DDP: lastStep when the group restart in groupRestart was counted (-1 before any step).", None
    )
    workers_done_time: float | None = field("When every worker of a PS job had finished (unix seconds).", None)
    active_seconds: float = field("Time the job ran before activeSince (seconds; suspended time excluded).", 0.0)
    active_since: float | None = field("When the current active period began (unix seconds); None while stopped.", None)
    size: int | None = field(
        "The size the job runs at (spec.size when it last took it): a spec.replicas that differs is a resize.", None
    )
    resize_time: float | None = field(
        "When a ParameterServer job last took a new size, live (unix seconds): workers above the size still "
        "running RELEASE_GRACE_SECONDS (120 s) after it are stopped.", None
    )
    steps_per_second: float | None = field(
        "Recent training steps per second (engine/eta.py: a moving average), the ETA's rate.", None)
    unschedulable_since: float | None = field(
        "Since when some replica could not be scheduled (unix seconds): the schedulingTimeoutSeconds clock.", None
    )
    set_aside_warned: str = field(
        "The last CheckpointSetAside Warning's mark (restarts/checkpoints set aside): one Warning per process that "
        "set damaged checkpoints aside.", "")
    skew_warned: str = field(
        "The operator version that last warned of the job's trainer version (a TrainerVersionSkew Event): one "
        "Warning per operator version.", "")


# The job's status: what users read, and what the engine remembers between rounds (`memory`). Decided by
# the engine alone (engine/engine.py) for both of its drivers, and kept whole by each: the API server's copy
# for the operator, state.json for a local run. What a driver keeps beside it is its own:
# `controller.state.JobState` (the operator's cache of a job), `local.rundir.RunState` (a local run's wall
# time, invocations and restart log). The docstring below is the CRD's description of `status`.
@dataclass
class JobStatus:
    """Observed state, written by the operator."""

    observed_generation: int = field("The spec generation last acted on.", 0)
    state: str = field("Created, Running, Restarting, Suspended, Succeeded or Failed.", "Created")
    workers: int = field("Processes that train (workers or ranks).", 0)
    replicas: int = field(
        "The size the job's replicas run at (ParameterServer workers, DDP nodes, 1 for Single): spec.replicas "
        "once a resize is done; the scale subresource's status.", 0)
    selector: str = field(
        "The label selector of the pods that status.replicas counts (the scale subresource's selector).", "")
    start_time: str | None = field("When the job first started (RFC 3339).", None)
    completion_time: str | None = field("When the job succeeded or failed (RFC 3339).", None)
    conditions: list[Condition] = field("The job's conditions, one per type that has ever been true.", default_factory=list)
    replica_statuses: dict[str, ReplicaCounts] = field("Replicas by role.", default_factory=dict)
    restarts: int = field("Replica restarts so far.", 0)
    restarts_without_progress: int = field("Restarts in a row that saw no new checkpoint.", 0)
    last_checkpoint: LastCheckpoint | None = field("The newest durable checkpoint.", None)
    progress: Progress | None = field("Training progress.", None)
    quorum: Quorum | None = field(
        "Fault-tolerant DDP (spec.ddp.faultTolerance): the replica groups in the current quorum, of how many.", None)
    trainer: TrainerImage | None = field(
        "The trainer the job's replicas run (its image and kubetrain version), recorded when the job first starts "
        "and kept for its life.", None)
    memory: JobMemory = field("What the engine remembers between rounds (internal).", default_factory=JobMemory)


STATUS_CLASSES = (JobStatus, JobMemory, Progress, Quorum, TrainerImage, LastCheckpoint, ReplicaCounts,
                  Condition)


def read_status(data: Any) -> JobStatus:
    """The typed status from the API's (or a run directory's) copy.

    Lenient: a field that does not parse (written by an older version, or by
    hand) is left at its default rather than losing the rest; unknown keys are
    ignored. An empty or missing status is a new job's.
    """
    if not isinstance(data, dict):
        return JobStatus()
    status: JobStatus = read_object(JobStatus, data)
    return status


def read_object(cls: type, data: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f, info in schema.fields_of(cls):
        key = schema.yaml_name(f)
        if key not in data:
            continue
        value = data[key]
        if info.kind == "object" and isinstance(value, dict):
            assert info.cls is not None
            kwargs[f.name] = read_object(info.cls, value)
            continue
        problems: list[schema.Problem] = []
        parsed = schema.parse_value(value, info, schema.meta_of(f), key, problems)
        if parsed is not schema.MISSING and not problems:
            kwargs[f.name] = parsed
    return cls(**kwargs)


def to_dict(status: JobStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase; unset optionals left out)."""
    data: dict[str, Any] = schema.to_dict(status)
    return data


def field_names(cls: type) -> list[str]:
    return [schema.yaml_name(f) for f in fields(cls)]
