"""The job engine: one pure state machine for every mode, driven by the operator and by the local backend.

`step(job, status, replicas, now, progress)` takes the spec, the last status
(its `memory` included), neutral observations of the replicas (a pod, or a
local process: which phase, how it ended, which incarnation), the progress
read from the chief and the clock, and returns the new status and the
actions: replicas to start, replicas to stop, Events, whether the job may be
deleted, when to look again. Nothing here knows about pods or processes; the
two drivers (`core.reconcile` + `controller` for a cluster, `local.backend`
for this machine) only observe and act, so every timer, the hang rule, the
deadline clock, suspend and completion behave the same in both.

The round runs in phases, each a function below:

1. `_fold_progress`: the newest step, loss, checkpoint; the hang clock.
2. finished already: only the TTL is left (`_after_the_end`).
3. suspended: stop everything (`_suspend`); likewise while a queue (Kueue) has not admitted
   the job or evicted it (`_wait_for_admission`).
   Then `_record_trainer`: the trainer the job runs for its whole life (status.trainer), recorded once.
4. the deadline, on the job's active time (suspended time excluded).
5. `_failures`: which replicas stopped, by failure, deletion, replacement, a lost node or hang.
6. `_decide`: the restart policy for each; a restart stops the replica now and
   starts it when its backoff is due.
7. `_starts`: replicas that should run and do not, once any backoff is due.
8. `_unschedulable_too_long`: the schedulingTimeoutSeconds clock.
9. `_outcome`: success, the parameter servers' drain, or the state to report (with why
   replicas wait, `_problem`: an image that does not pull, a claim not bound, no node).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubetrain.shared import __version__
from kubetrain.shared.exitcodes import EXIT_RELEASED
from kubetrain.shared.launch import LIGHTHOUSE
from kubetrain.shared.timestamps import iso, parse_iso

from kubetrain.api import TrainingJob, versions
from kubetrain.api.spec import MAX_REPORTED_METRICS
from kubetrain.api.status import (
    JobMemory,
    JobStatus,
    LastCheckpoint,
    Progress,
    Quorum,
    ReplicaCounts,
    TrainerImage,
    read_status,
)
from . import eta, policy
from .children import selector
from .plan import chief, replica_names
from .conditions import TERMINAL, Observed, conditions

RELEASE_GRACE_SECONDS = 120.0
"""A ParameterServer job resized down: ps-0 releases each worker above the new size, which exits 0 after
the step it is in. ps-0 reads its job file about once a second; in a cluster the file is a mounted ConfigMap
that the kubelet refreshes within seconds of the pod update the operator makes (the size annotation),
otherwise only on its periodic sync (60 s by default, plus its ConfigMap cache's TTL). A worker still running
this long after the resize was not released (its ps-0 never read the new size, or the worker hangs): it is
stopped as any replica is (SIGTERM, a kill after the grace period), an Event says so."""

PS_DRAIN_SECONDS = 60.0
"""Parameter servers exit by themselves once every worker finished and they wrote their final
checkpoint; one still running this long afterwards is stopped and the job succeeds."""

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
WAITING_REASONS = ("ImagePullFailed", "VolumePending", "Unschedulable")
"""Why a job's replicas wait (the reason on its condition while they do; `_problem`): a fixed set, so
that the operator's gauge of waiting jobs has bounded labels."""
MAX_REQUEUE_SECONDS = 60.0
"""A running job is looked at again at least this often, by default (`step`'s `safety_net`; the operator
stretches it when it holds many jobs, drivers/cluster/state.safety_net_seconds): a safety net. What changes a job brings its
own round: a pod's event, a scrape whose progress changed (the operator's scrape ticker reads each
running job's chief every 10 s on its own; the local driver reads the event logs every round), and
every clock the engine keeps (hang, deadlines, backoff, TTL) asks for a round when it runs out
(`_requeue`). At 10 s, 1,000 running jobs cost the operator 100 rounds a second, a whole core, to
find nothing new."""

ACTIVE = ("Running", "Restarting")


@dataclass(frozen=True)
class ReplicaObservation:
    """What the engine needs of one replica: a pod in a cluster, a process group on this machine."""

    replica: str
    phase: str  # Pending | Running | Succeeded | Failed
    exit_code: int | None = None  # once terminated
    reason: str = ""  # why it ended without an exit code (Evicted, ...)
    waiting_reason: str = ""  # ImagePullBackOff, CrashLoopBackOff, ...
    waiting_message: str = ""
    terminating: bool = False  # being stopped
    restart_count: int = 0  # restarts in place (a StatefulSet's container); 0 for a process
    last_exit_code: int | None = None  # how the last in-place run ended
    node: str = ""
    ip: str = ""
    uid: str = ""  # the incarnation (a pod uid): the same name can come back as another one
    final: Mapping[str, Any] | None = None  # the replica's final results (a pod's termination message)
    unschedulable: str = ""  # why the scheduler cannot place it (PodScheduled=False, Unschedulable): its message
    node_lost: bool = False  # the control plane evicted it because its node stopped answering
    deletion_due: float | None = None  # when its graceful deletion's grace period ends (unix seconds)
    message: str = ""  # why it failed, in kubetrain's own words (a pod's model-init container's error line)
    image: str = ""  # the image its trainer runs (a pod's `trainer` container's); "" for a local process


@dataclass(frozen=True)
class ProgressReading:
    """Progress read from the chief (its metrics in a cluster, its event log on this machine)."""

    step: int
    total_steps: int | None = None
    loss: float | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    samples_per_second: float | None = None
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None  # unix seconds
    metrics: Mapping[str, float] | None = None  # what a script reported by name (kubetrain.report)
    quorum: int | None = None  # fault-tolerant DDP: replica groups in the reader's current quorum
    set_aside: int | None = None
    """Damaged checkpoints the chief's current process set aside at its restore (kept, never deleted) before it
    resumed from an older one: kubetrain_checkpoints_set_aside_total, or its event log's checkpoint_set_aside."""
    set_aside_detail: str | None = None
    """Which and why, where the driver can read it (the event log on this machine; in a cluster, the replica's
    log has them)."""


@dataclass(frozen=True)
class ProgressUnknown:
    """The driver could not read the chief's progress: its read has not run lately (the operator's reads of
    tenants' /metrics wait their turn in a bounded pool, drivers/cluster/scrapes.py), or it failed in the
    operator itself. Not a reading of no progress (that is None: nothing to read, or the job's own pods
    refused, answered without a step or stalled past their deadline): the hang
    clock cannot tell a job that stands still from one whose reads wait, so it never ends in Hung on it. The
    next reading settles it: a new step, or the same step, which is then a hang if the deadline passed."""


PROGRESS_UNKNOWN = ProgressUnknown()


SHOWN_AS_READ = ("step", "total_steps", "loss", "eval_accuracy", "eval_loss", "eval_perplexity", "samples_per_second")
"""What status.progress shows of a reading as it was read; its metrics are copied, its ETA computed and its
updateTime stamped by the engine."""


@dataclass(frozen=True)
class Restarted:
    """A restart the engine decided, for the drivers' logs and metrics."""

    replica: str
    reason: str
    exit_code: int | None
    delay_seconds: float
    step: int | None
    checkpoint_step: int


@dataclass(frozen=True)
class QueueAdmission:
    """What a queue (Kueue, engine/kueue.py) says of the job: may it run now, and if not why.
    A job outside any queue has none and always may."""

    admitted: bool
    reason: str = ""  # WorkloadPending | QueuedForAdmission | Resizing | Evicted | Preempted | Admitted | Finished
    message: str = ""
    evicted: bool = False  # admitted once, now evicted: stopped with a checkpoint, then queued again


@dataclass(frozen=True)
class Refusal:
    """Why the job may not run at all, found outside the engine's view of its replicas: a spec the API
    model refuses (InvalidSpec), pods the installation's pod security refuses (PodSecurity), a gang no
    scheduler of the cluster serves (GangSchedulingDisabled). A driver that finds one passes it to `step`
    (or, when there is no spec to step with, to `refuse`): the job fails for good, its clock paused,
    with completionTime, an Event and the Failed condition, as any failure the engine decides."""

    reason: str  # CamelCase
    message: str  # a sentence a user can act on


@dataclass(frozen=True)
class Problem:
    """A problem a driver met while carrying out a round (the API refused or throttled a call, a child
    belongs to someone else, RBAC lacks a verb): shown on the condition of the job's current state
    until a round succeeds (engine/conditions.PROBLEM_REASONS), the state itself unchanged (`note`)."""

    reason: str  # CamelCase
    message: str  # a sentence a user can act on


@dataclass
class Actions:
    start: list[str] = field(default_factory=list)  # replicas to start now
    stop: list[str] = field(default_factory=list)  # replicas to stop gracefully now
    hold: bool = False  # nothing of the job may run (suspended, or finished and cleaned up)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    restarted: list[Restarted] = field(default_factory=list)
    failed: str | None = None  # the replica whose failure ended the job
    delete_job: bool = False  # its TTL after finishing has passed
    requeue_after: float | None = None  # seconds until the engine wants to look again
    resized: bool = False  # a resize is done: render what carries the size again (the job file, a StatefulSet)


@dataclass
class Round:
    status: JobStatus
    actions: Actions


def step(
    job: TrainingJob,
    status: JobStatus | Mapping[str, Any] | None,
    replicas: Mapping[str, ReplicaObservation],
    now: float,
    progress: ProgressReading | ProgressUnknown | None = None,
    volume_pending: list[str] | None = None,
    admission: QueueAdmission | None = None,
    refusal: Refusal | None = None,
    safety_net: float = MAX_REQUEUE_SECONDS,
    trainer: TrainerImage | None = None,
) -> Round:
    """One round of the state machine. Pure: the old status is not changed. `progress`: the chief's reading,
    None when there is none to read, PROGRESS_UNKNOWN when it could not be read. `refusal`: the job may not
    run at all (`Refusal`); it fails, unless it has ended already. `safety_net`: the seconds after which a
    job that has not ended asks for a round even when no clock of its runs out. `trainer`: what the driver
    starts a job's replicas with when the job has none recorded (the operator's trainer image and version; a
    local run's installed kubetrain, image ""); None records nothing (`_record_trainer`)."""
    old = status if isinstance(status, JobStatus) else read_status(status)
    return _Round(job, copy.deepcopy(old), dict(replicas), now, safety_net, trainer).run(
        progress, volume_pending or [], admission, refusal)


def refuse(status: JobStatus, refusal: Refusal, now: float, generation: int, ttl: int | None = None) -> Round:
    """The round of a job that has no spec to step with (it does not parse: InvalidSpec): it fails as
    `step` fails a refused job, its clock paused, unless it has ended already. `ttl`: its
    runPolicy.ttlSecondsAfterFinished, when the driver could still read one: the job is deleted that long
    after it ended, as a finished job's TTL does (`_after_the_end`). Pure."""
    out = copy.deepcopy(status)
    actions = Actions()
    if out.state not in TERMINAL:
        _end(out, "Failed", now)
        out.observed_generation = generation
        out.conditions = conditions(out.conditions, Observed("Failed", refusal.reason, refusal.message), iso(now),
                                    generation)
        actions.events.append(("Warning", refusal.reason, refusal.message))
    actions.delete_job, actions.requeue_after = _ttl_round(ttl, out, now)
    return Round(out, actions)


def _ttl_round(ttl: int | None, status: JobStatus, now: float) -> tuple[bool, float | None]:
    """A finished job's TTL: (delete it now, or else the seconds until its TTL's round; None: no TTL)."""
    done = parse_iso(status.completion_time)
    if ttl is None or done is None:
        return False, None
    if now - done >= ttl:
        return True, None
    return False, ttl - (now - done)


def note(status: JobStatus, problem: Problem, now: float, generation: int) -> JobStatus:
    """The status with `problem` on the condition of the job's current state (a new job's: Created);
    the state, the clocks and the memory unchanged. Pure."""
    out = copy.deepcopy(status)
    out.conditions = conditions(out.conditions, Observed(out.state or "Created", problem.reason, problem.message),
                                iso(now), generation)
    return out


def _end(status: JobStatus, state: str, now: float) -> None:
    """What ending does to the status, in every way a job ends: the state, completionTime (the first
    end's), the ETA, the active-time clock paused, no restart left pending."""
    status.state = state
    status.completion_time = status.completion_time or iso(now)
    if status.progress is not None:  # nothing is left to estimate
        status.progress.eta_seconds = 0 if state == "Succeeded" else None
    memory = status.memory
    if memory.active_since is not None:
        memory.active_seconds += max(0.0, now - memory.active_since)
        memory.active_since = None
    memory.pending_restarts = {}


class _Round:
    """The state of one round while its phases run (private: `step` is the interface)."""

    def __init__(self, job: TrainingJob, status: JobStatus, replicas: dict[str, ReplicaObservation], now: float,
                 safety_net: float = MAX_REQUEUE_SECONDS, trainer: TrainerImage | None = None):
        self.job = job
        self.safety_net = safety_net
        self.trainer = trainer
        self.spec = job.spec
        self.status = status
        self.memory: JobMemory = status.memory
        self.replicas = replicas
        self.now = now
        self.actions = Actions()
        self.before = status.state or "Created"
        self.names = [f"{role}-{index}" for role, index in replica_names(job)]
        self.is_ddp = self.spec.mode == "DDP"
        self.observed: Observed | None = None
        self.departing: dict[str, ReplicaObservation] = {}  # workers above the size (`_release`)
        self.progress_unknown = False  # this round's progress could not be read (`ProgressUnknown`)
        self.rank_ends: dict[str, str] = {}  # plain DDP ranks that ended this round: how (`_with_its_group`)

    def run(self, progress: ProgressReading | ProgressUnknown | None, volume_pending: list[str],
            admission: QueueAdmission | None = None, refusal: Refusal | None = None) -> Round:
        self._fold_progress(progress)
        if self.before in TERMINAL:
            self._after_the_end()
            return self._done(report=False)
        if refusal is not None:
            self._finish("Failed", refusal.reason, refusal.message)
            return self._done()
        if self.spec.run_policy.suspend:
            self._suspend()
            return self._done()
        if admission is not None and not admission.admitted:
            self._wait_for_admission(admission)
            return self._done()
        self._resume_if_suspended()
        self._record_trainer()
        if self._deadline_passed():
            return self._done()
        if self._resizing():
            return self._done()
        self._release()
        for failure in self._failures():
            if self._with_its_group(failure.replica):
                continue
            if not self._decide(failure):
                return self._done()
        self._starts()
        if self._unschedulable_too_long():
            return self._done()
        self._outcome(volume_pending)
        return self._done()

    # -- 1. progress -----------------------------------------------------------------

    def _fold_progress(self, progress: ProgressReading | ProgressUnknown | None) -> None:
        if not isinstance(progress, ProgressReading):
            self.progress_unknown = isinstance(progress, ProgressUnknown)
            return
        memory = self.memory
        if memory.last_step is None or progress.step > memory.last_step:
            if memory.last_step is not None and memory.last_step_time is not None:
                memory.steps_per_second = eta.steps_per_second(
                    memory.steps_per_second, progress.step - memory.last_step, self.now - memory.last_step_time)
            memory.last_step = progress.step
            memory.last_step_time = self.now
            memory.group_restart, memory.group_restart_step = [], None  # the group trains again: it is over
        reading = Progress(**{name: getattr(progress, name) for name in SHOWN_AS_READ},
                           metrics=dict(progress.metrics) if progress.metrics else None)
        old = self.status.progress
        if self.before in TERMINAL:
            reading.eta_seconds = old.eta_seconds if old is not None else None  # _finish's, kept
        else:
            reading.eta_seconds = eta.eta_seconds(progress.step, progress.total_steps, memory.steps_per_second)
        if old is None or dataclasses.replace(old, update_time=None) != reading:
            # Written when it changes: a job that stands still costs no status write.
            reading.update_time = iso(self.now)
            self.status.progress = reading
        old_checkpoint = self.status.last_checkpoint
        if progress.checkpoint_step and not (self.spec.fault_tolerant and old_checkpoint is not None
                                             and progress.checkpoint_step < old_checkpoint.step):
            # A fault-tolerant job's groups each write their own checkpoints, and its progress is read from
            # whichever group answers (the chief, else the next): one that healed later holds older ones.
            # The job's newest is the newest of any group (losing every group restores it: the others heal
            # from it), so the status never goes back to another group's older one (the soak saw 1650, 1550).
            self.status.last_checkpoint = LastCheckpoint(
                progress.checkpoint_step, iso(progress.checkpoint_time or self.now)
            )
        self._report_set_aside(progress)
        if progress.quorum is not None and self.spec.fault_tolerant:
            assert self.spec.ddp is not None
            quorum = Quorum(participants=progress.quorum, groups=self.spec.ddp.groups)  # spares included
            old_quorum = self.status.quorum
            if old_quorum is None or dataclasses.replace(old_quorum, update_time=None) != quorum:
                quorum.update_time = iso(self.now)
                self.status.quorum = quorum

    def _report_set_aside(self, progress: ProgressReading) -> None:
        """A Warning once per process that set damaged checkpoints aside at its restore (what a bucket's or a
        claim's writer can do at most: make the job fall back): which and why where the driver knows it."""
        if not progress.set_aside:
            return
        mark = f"{self.status.restarts}/{progress.set_aside}"
        if self.memory.set_aside_warned == mark:
            return
        self.memory.set_aside_warned = mark
        which = f": {progress.set_aside_detail}" if progress.set_aside_detail else (
            " (the chief replica's log names each and why)")
        resumed = self.status.last_checkpoint.step if self.status.last_checkpoint else progress.step
        self.actions.events.append((
            "Warning", "CheckpointSetAside",
            f"{progress.set_aside} damaged checkpoint(s) set aside at the restore, kept, and the one before "
            f"used (the job goes on from step {resumed}){which}"))

    # -- 2. finished -----------------------------------------------------------------

    def _after_the_end(self) -> None:
        delete, wait = _ttl_round(self.spec.run_policy.ttl_seconds_after_finished, self.status, self.now)
        self.actions.delete_job = delete
        if wait is not None:
            self._requeue(wait)

    def _finish(self, state: str, reason: str, message: str) -> None:
        self.observed = Observed(state, reason, message)
        _end(self.status, state, self.now)
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        if ttl is not None:  # the TTL's round: no later event may come (our own status echo queues none)
            self._requeue(ttl)
        clean = self.spec.run_policy.clean_pod_policy
        self.actions.stop += [
            n for n, r in {**self.replicas, **self.departing}.items()
            if (clean == "All" or (clean == "Running" and r.phase in ("Pending", "Running"))) and n not in self.actions.stop
        ]  # fmt: skip
        self.actions.hold = clean != "None"
        lighthouse = self.replicas.get(LIGHTHOUSE)
        if lighthouse is not None and lighthouse.phase in ("Pending", "Running") and LIGHTHOUSE not in self.actions.stop:
            self.actions.stop.append(LIGHTHOUSE)  # no group is left to serve: it stops whatever cleanPodPolicy says
        self.actions.events.append(("Normal" if state == "Succeeded" else "Warning", reason, message))
        if state == "Succeeded":
            self._final_progress()

    # -- 3. suspend --------------------------------------------------------------------

    def _suspend(self) -> None:
        self.actions.stop = [n for n, r in self.replicas.items() if r.phase in ("Pending", "Running") and not r.terminating]
        self.actions.hold = True
        if self.before != "Suspended":
            self.actions.events.append(("Normal", "Suspended", "The job is suspended; its replicas stop after a checkpoint."))
        self.observed = Observed("Suspended", "Suspended", "The job is suspended; set spec.runPolicy.suspend to false to resume.")
        self.status.state = "Suspended"
        self._pause_clock()
        self.memory.pending_restarts = {}
        self.memory.identities = {}  # the replicas that come back on resume are new, not replacements
        self.memory.unschedulable_since = None  # its pods are gone; the clock starts again with new ones

    def _wait_for_admission(self, admission: QueueAdmission) -> None:
        """Held as a suspended job is, with the queue's reason: never started until admitted; once
        evicted or preempted, its replicas stop gracefully (the trainers' final checkpoint) and
        the job resumes from that checkpoint when the queue admits it again."""
        self.actions.stop = [n for n, r in self.replicas.items() if r.phase in ("Pending", "Running") and not r.terminating]
        self.actions.hold = True
        message = admission.message
        ran_at = self.memory.size
        if ran_at is not None and ran_at != self.spec.size and admission.reason != "Resizing":
            # The new size's Workload waits: Kueue's words alone would not say why a job that ran stopped.
            unit = "nodes" if self.is_ddp else "workers"
            message = f"Resized from {ran_at} to {self.spec.size} {unit}, not admitted at the new size yet. {message}"
        old = next((c for c in self.status.conditions if c.type == "Suspended"), None)
        if self.before != "Suspended" or old is None or old.reason != admission.reason:
            kind = "Warning" if admission.evicted else "Normal"
            self.actions.events.append((kind, admission.reason, message))
        self.observed = Observed("Suspended", admission.reason, message)
        self.status.state = "Suspended"
        self._pause_clock()
        self.memory.pending_restarts = {}
        self.memory.identities = {}

    def _resume_if_suspended(self) -> None:
        if self.status.start_time is None:
            self.status.start_time = iso(self.now)
        if self.memory.active_since is None:
            self.memory.active_since = self.now
        if self.before == "Suspended":
            if self.memory.last_step is not None:
                self.memory.last_step_time = self.now  # the hang clock restarts with the replicas
            self.actions.events.append(("Normal", "Resumed", "The job resumes from its newest checkpoint."))

    def _pause_clock(self) -> None:
        if self.memory.active_since is not None:
            self.memory.active_seconds += max(0.0, self.now - self.memory.active_since)
            self.memory.active_since = None

    # -- 3b. the trainer -----------------------------------------------------------------

    def _record_trainer(self) -> None:
        """The job's trainer (status.trainer), recorded once, before its first replicas start: what they start
        with (spec.image, else the operator's trainer image). A job that an older operator started has none
        recorded: the image its replicas run is recorded instead, while one can be seen, so that an upgraded
        operator starts the job's later pods (a restarted replica, a DDP StatefulSet rendered again at a resize)
        with the trainer the others run: a job never mixes trainer versions (a ParameterServer job's shards and
        workers talk gRPC to each other). A local run's record (image "") follows the installed kubetrain, which
        is what its processes run.

        A trainer outside the operator's window (versions.skew: n-1) is a Warning Event, once per operator
        version (`memory.skew_warned`); the job runs on."""
        default = self.trainer
        if default is None:
            return
        recorded = self.status.trainer
        if not default.image:  # a local run: processes of the installed kubetrain, whatever spec.image says
            recorded = self.status.trainer = TrainerImage(image="", version=default.version)
        elif recorded is None:
            image = self._running_image() or self.spec.image or default.image
            version = versions.image_version(image) or (default.version if image == default.image else "")
            recorded = self.status.trainer = TrainerImage(image=image, version=version)
        why = versions.skew(recorded.version, __version__)
        if why is not None and self.memory.skew_warned != __version__:
            self.memory.skew_warned = __version__
            self.actions.events.append(("Warning", versions.SKEW_REASON, why))

    def _running_image(self) -> str:
        """The trainer image the job's replicas run, as observed (the chief's first); "" when none is seen."""
        head = chief(self.job)
        for name in [head, *sorted(n for n in self.replicas if n != head)]:
            seen = self.replicas.get(name)
            if seen is not None and seen.image:
                return seen.image
        return ""

    # -- 4. deadline -------------------------------------------------------------------

    def active_seconds(self) -> float:
        since = self.memory.active_since
        return self.memory.active_seconds + (max(0.0, self.now - since) if since is not None else 0.0)

    def _deadline_passed(self) -> bool:
        deadline = self.spec.run_policy.active_deadline_seconds
        if deadline is None:
            return False
        left = deadline - self.active_seconds()
        if left > 0:
            self._requeue(left)
            return False
        self._finish("Failed", "DeadlineExceeded", f"The job ran longer than activeDeadlineSeconds ({deadline} s).")
        return True

    # -- 4b. resize ----------------------------------------------------------------------

    def _resizing(self) -> bool:
        """spec.replicas changed (`kubectl scale`). True while replicas of the old size are still stopping.

        A ParameterServer job resizes live (`_resize_live`): nothing stops. A DDP job restarts at the new
        size: every replica stops after a checkpoint (as for suspend), then the round that finds none left
        records the new size and starts them at it (torchrun's group has a fixed --nnodes); the trainers
        deal the data of the epoch in progress again among the new set."""
        memory, size = self.memory, self.spec.size
        if memory.size is None or memory.size == size:
            memory.size = size
            return False
        if not self.is_ddp or self.spec.fault_tolerant:
            self._resize_live()
            return False
        unit = "nodes"
        if self.replicas:
            # Every one, whatever its phase: a pod that failed or finished (a worker done before the
            # others) would otherwise stay, and the round that finds none left would never come.
            self.actions.stop = [n for n, r in self.replicas.items() if not r.terminating]
            self.actions.hold = True
            message = (f"Resizing from {memory.size} to {size} {unit}: the replicas stop after a checkpoint and "
                       "start again at the new size.")
            old = next((c for c in self.status.conditions if c.type == "Restarting" and c.status == "True"), None)
            if old is None or old.reason != "Resizing":
                self.actions.events.append(("Normal", "Resizing", message))
            self.observed = Observed("Restarting", "Resizing", message)
            memory.pending_restarts = {}
            self._requeue(0.5)
            return True
        self.actions.events.append(("Normal", "Resized", f"Resized from {memory.size} to {size} {unit}; the job "
                                                         "resumes from its newest checkpoint."))
        memory.size = size
        memory.pending_restarts = {}
        memory.identities = {}
        if memory.last_step is not None:
            memory.last_step_time = self.now  # the hang clock restarts with the replicas
        self.actions.resized = True
        return False

    def _resize_live(self) -> None:
        """A ParameterServer job takes its new size while it runs. The new size is recorded at once and
        the job file rendered again (`actions.resized`); ps-0 reads it about once a second and deals the
        rest of the epoch again among the new set at a consistent cut. Workers below the new size that
        have no replica start now (`_starts`) and join; those above it are released by ps-0 and exit 0
        after their step (`_release`). Nothing is stopped, no restart is counted, the state stays what it
        is: the replicas that keep running are the same incarnations (`memory.identities` stays). A job
        resized while its replicas were stopped (suspended, or held by its Kueue queue until the Workload of
        the new size is admitted) starts them all now at the new size, and its Event says that instead.

        A fault-tolerant DDP job resizes live too: each node is a replica group of its own, so new groups
        start and join the quorum (copying the model from a live group), the groups above the size are
        stopped (`_release_groups`: SIGTERM, a checkpoint, then they leave the quorum), and the others
        train on untouched."""
        memory, size = self.memory, self.spec.size
        before = memory.size
        assert before is not None  # _resize calls this only with a size recorded
        groups = self.spec.fault_tolerant
        unit, role = ("replica groups", "ddp") if groups else ("workers", "worker")
        if self.before == "Suspended":
            # Resized while its replicas were stopped (suspended, or a queued job whose Workload Kueue
            # admitted again at the new size): every replica starts now, from the newest checkpoint.
            self.actions.events.append(("Normal", "Resized", f"Resized from {memory.size} to {size} {unit} while "
                                                             "stopped: the job resumes at the new size from its "
                                                             "newest checkpoint."))
        else:
            if size > before:
                how = f"{_listed(range(before, size), role)} {'joins' if size - before == 1 else 'join'}"
            else:
                one, more = ("leaves", "leave") if groups else ("leaves after its step", "leave after their step")
                how = f"{_listed(range(size, before), role)} {one if before - size == 1 else more}"
            then = "the other groups train on" if groups else f"ps-0 deals the rest of the epoch again among the {size}"
            self.actions.events.append(("Normal", "Resized", f"Resized from {memory.size} to {size} {unit}, live: "
                                                             f"{how}; {then}; nothing restarts."))
        memory.size = size
        memory.resize_time = self.now
        # A restart due for a worker above the new size is not wanted any more; the others stand. A group
        # above it is forgotten: scaled up again, its new pod is a new member, not a replacement.
        memory.pending_restarts = {n: t for n, t in memory.pending_restarts.items() if n in self.names}
        memory.identities = {n: uid for n, uid in memory.identities.items() if n in self.names}
        memory.in_place_restarts = {n: c for n, c in memory.in_place_restarts.items() if n in self.names}
        memory.workers_done_time = None  # new workers have work to do; the drain clock starts again when they are done
        self.actions.resized = True

    def _release(self) -> None:
        """The workers above a ParameterServer job's size (it was resized down) are no part of the job: taken
        out of this round's replicas, so that no failure, success, restart, count or waiting reason sees them.
        A running one is left alone: ps-0 releases it and it exits EXIT_RELEASED after its step. One that
        ended (however) or never ran (Pending) is stopped (its pod deleted); so is one still running
        RELEASE_GRACE_SECONDS after the resize.

        A worker of the job's size that ended released was scaled away and back before it left (3 -> 1 -> 3
        within a step: ps-0 released it at the first resize and waits for it at the second): it rejoins,
        stopped and started again as a restart is (`pending_restarts`, due now) but counted as none."""
        if self.spec.fault_tolerant:
            self._release_groups()
            return
        if self.is_ddp:
            return
        for name in self.names:
            seen = self.replicas.get(name)
            if seen is None or name in self.memory.pending_restarts or not _released(seen):
                continue
            self.memory.pending_restarts[name] = self.now
            if not seen.terminating:
                self.actions.stop.append(name)
            self.actions.events.append(("Normal", "Rejoining",
                                        f"{name} was released by ps-0 at a resize and the job has "
                                        f"{self.spec.size} workers again: it starts again and joins; "
                                        "no restart is counted."))
        wanted = set(self.names)
        for name in [n for n in self.replicas if n not in wanted]:
            seen = self.departing[name] = self.replicas.pop(name)
            if seen.terminating:
                continue
            if seen.phase != "Running":
                self.actions.stop.append(name)
                continue
            since = self.memory.resize_time if self.memory.resize_time is not None else self.now
            left = RELEASE_GRACE_SECONDS - (self.now - since)
            if left > 0:
                self._requeue(left)
                continue
            self.actions.stop.append(name)
            self.actions.events.append(("Warning", "ReleaseTimeout",
                                        f"{name} is above the job's size ({self.spec.size} workers) and still ran "
                                        f"{RELEASE_GRACE_SECONDS:.0f} s after the resize, not released by ps-0: "
                                        "stopped."))

    def _release_groups(self) -> None:
        """The replica groups above a fault-tolerant job's size (it was resized down) are no part of the job:
        taken out of this round's replicas, and stopped (a group on SIGTERM writes a checkpoint and leaves
        the quorum; in a cluster the StatefulSet's scale-down deletes their pods as well)."""
        wanted = set(self.names)
        for name in [n for n in self.replicas if n not in wanted]:
            seen = self.departing[name] = self.replicas.pop(name)
            if not seen.terminating and name not in self.actions.stop:
                self.actions.stop.append(name)

    # -- 5. failures -------------------------------------------------------------------

    def _failures(self) -> list[policy.Failure]:
        memory = self.memory
        failures: list[policy.Failure] = []
        for name in self.names:
            if name in memory.pending_restarts:
                continue
            seen = self.replicas.get(name)
            if seen is not None and seen.node_lost:
                # Evicted from a node that stopped answering: replaced elsewhere, once (its name is
                # in pending_restarts until the replacement runs, however long the old pod lingers).
                failures.append(policy.Failure(name, reason="NodeLost"))
                continue
            if seen is None:
                # Gone without the engine asking: deleted (a DDP replica's StatefulSet
                # brings it back, seen below as a new incarnation). After a resize every
                # replica is gone on purpose.
                if self.before in ACTIVE and not self.is_ddp and not self.actions.resized:
                    failures.append(policy.Failure(name, reason="Deleted"))
                continue
            if self.is_ddp and seen.uid:
                known = memory.identities.get(name)
                memory.identities[name] = seen.uid
                if known and known != seen.uid and self.before in ACTIVE:
                    # Replaced (deleted, evicted, its node gone) before a round saw it missing.
                    memory.in_place_restarts[name] = seen.restart_count
                    self.rank_ends[name] = "was replaced"
                    failures.append(policy.Failure(name, reason="Deleted"))
                    continue
            failure = _failure(seen)
            if failure is not None:
                failures.append(failure)
            elif seen.restart_count > memory.in_place_restarts.get(name, 0):
                # Its container restarted in place (torchrun gave up): count it once.
                memory.in_place_restarts[name] = seen.restart_count
                if seen.last_exit_code not in (0, None):
                    self.rank_ends[name] = "restarted"
                    failures.append(policy.Failure(name, exit_code=seen.last_exit_code))
        if not failures and self._hung():
            # Which replica is stuck cannot be seen from outside; the chief is restarted.
            failures.append(policy.Failure(chief(self.job), reason="Hung"))
        return failures

    def _with_its_group(self, name: str) -> bool:
        """Whether a plain DDP rank's end (its container restarted in place, or its pod replaced: `rank_ends`)
        is part of the group restart counted last, in this round or an earlier one: another rank's, and the
        job has not stepped since. torchrun on the other nodes ends when the rendezvous host's node ends (its
        store goes with it), so one SIGKILLed ddp-0 ended every node, each end a restart in place of its own:
        the soak counted two restarts for one fault. Each rank joins a group restart once: a rank that ends
        again before the job steps is a restart of its own, counted (a crash loop still meets backoffLimit).
        The mark is the newest step, which only grows: the group resumes from a checkpoint, so ends until it
        steps past its newest step before the fault are taken for that fault's (a new fault of another rank
        in that window goes uncounted: the window is the restart's own)."""
        memory = self.memory
        what = self.rank_ends.get(name)
        if what is None or not self.is_ddp or self.spec.fault_tolerant:
            return False
        step = memory.last_step if memory.last_step is not None else -1
        if not memory.group_restart or memory.group_restart_step != step or name in memory.group_restart:
            return False
        memory.group_restart.append(name)
        self.actions.events.append(("Normal", "RestartedWithItsGroup",
                                    f"{name} {what} with its torchrun group, whose restart for "
                                    f"{memory.group_restart[0]} was counted: not counted again."))
        return True

    def _hung(self) -> bool:
        """No new step for progressDeadlineSeconds while replicas run. The clock starts with the
        first step read, so a job whose progress cannot be read is never taken for hung; nor is one whose
        progress is unknown now (ProgressUnknown: its read waited its turn behind other jobs'): four jobs whose pods never answered once held the operator's scrape pool, and every other
        job's reading went stale and was taken for one that stood still, restarted as Hung. No round is
        asked for then: the read that settles it changes the result, and that brings the round."""
        memory = self.memory
        if memory.last_step is None or memory.last_step_time is None or self.before not in ACTIVE:
            return False
        if _succeeded(self.replicas.get(chief(self.job)), self.is_ddp):
            return False  # training is over: what is left (the shards' drain) is no hang
        limit = self.spec.run_policy.progress_deadline_seconds
        left = limit - (self.now - memory.last_step_time)
        if left > 0:
            self._requeue(left)
            return False
        return not self.progress_unknown

    # -- 6. the restart policy ------------------------------------------------------------

    def _decide(self, failure: policy.Failure) -> bool:
        """Apply the restart policy; False when the job failed."""
        memory, status = self.memory, self.status
        checkpoint = status.last_checkpoint.step if status.last_checkpoint else 0
        progressed = checkpoint > memory.checkpoint_at_last_restart
        counters = policy.Counters(status.restarts, status.restarts_without_progress)
        decision, counters = policy.decide(self.spec, failure, counters, progressed)
        if decision.action == "fail":
            self.actions.failed = failure.replica
            self._finish("Failed", decision.reason, decision.message)
            return False
        status.restarts, status.restarts_without_progress = counters.restarts, counters.restarts_without_progress
        memory.checkpoint_at_last_restart = checkpoint
        name = failure.replica
        self.actions.events.append(("Warning", decision.reason, decision.message))
        self.actions.restarted.append(
            Restarted(name, decision.reason, failure.code, decision.delay_seconds, memory.last_step, checkpoint)
        )
        self.observed = Observed("Restarting", decision.reason, decision.message)
        memory.pending_restarts[name] = self.now + decision.delay_seconds
        seen = self.replicas.get(name)
        if seen is not None and failure.reason != "Deleted" and (failure.reason == "Hung" or not _restarted_in_place(seen)):
            self.actions.stop.append(name)
        memory.identities.pop(name, None)  # its replacement is this restart, not another one
        if self.is_ddp and not self.spec.fault_tolerant:
            memory.group_restart = [name]  # the other ranks' ends that follow are this one (_with_its_group)
            memory.group_restart_step = memory.last_step if memory.last_step is not None else -1
        if memory.last_step_time is not None:
            memory.last_step_time = self.now + decision.delay_seconds  # the hang clock restarts with it
        return True

    # -- 7. starts -----------------------------------------------------------------------

    def _starts(self) -> None:
        pending = self.memory.pending_restarts
        for name in self.names:
            due = pending.get(name)
            if due is not None and due > self.now:
                self._requeue(due - self.now)
                continue
            if name in self.actions.stop:
                self._requeue(0.1)  # started once it has stopped
                continue
            seen = self.replicas.get(name)
            if seen is None:
                self.actions.start.append(name)
                pending.pop(name, None)
            elif due is not None and _restarted_in_place(seen):
                del pending[name]  # it came back by itself (in place, or its StatefulSet made it again)
            elif due is not None:
                self._requeue(1.0)  # the old one is still being stopped

    # -- 8. waiting for room ------------------------------------------------------------

    def _unschedulable_too_long(self) -> bool:
        """The schedulingTimeoutSeconds clock: it runs while some replica cannot be scheduled and
        starts again once every one could; the job fails when it runs out."""
        memory = self.memory
        waiting = _unschedulable(self.replicas)
        if not waiting:
            memory.unschedulable_since = None
            return False
        if memory.unschedulable_since is None:
            memory.unschedulable_since = self.now
        limit = self.spec.run_policy.scheduling_timeout_seconds
        if limit is None:
            return False
        left = limit - (self.now - memory.unschedulable_since)
        if left > 0:
            self._requeue(left)
            return False
        names = ", ".join(seen.replica for seen in waiting)
        self._finish("Failed", "Unschedulable",
                     f"{names} could not be scheduled for schedulingTimeoutSeconds ({limit} s): {waiting[0].unschedulable}")
        return True

    # -- 9. outcome ----------------------------------------------------------------------

    def _outcome(self, volume_pending: list[str]) -> None:
        # A Lighthouse serves the replica groups and never finishes by itself: the groups decide.
        phases: dict[str, policy.ReplicaPhase] = {
            n: ("Succeeded" if _succeeded(self.replicas.get(n), self.is_ddp) else "Running")
            for n in self.names if n != LIGHTHOUSE
        }
        if self.observed is None and policy.job_outcome(phases) == "Succeeded":
            self._finish("Succeeded", "Completed", "Every replica finished.")
            return
        if self.observed is None and policy.shards_done_with_standbys(phases):
            # A shard exits 0 only once every worker's place has finished; a process still running then
            # stands by (a killed worker's replacement, whose place a standby took) and has nothing to do.
            self._finish("Succeeded", "Completed",
                         "Every worker's place finished; the standby workers still waiting were stopped.")
            self.actions.stop += [n for n in self.names if n.startswith(("worker-", "standby-"))
                                  and n in self.replicas and phases[n] != "Succeeded" and n not in self.actions.stop]
            return
        if self.observed is None and self.spec.fault_tolerant and any(p == "Succeeded" for p in phases.values()):
            self._groups_done(phases)
            return
        if self.observed is None and self.spec.mode == "ParameterServer" and policy.workers_done(phases):
            memory = self.memory
            if memory.workers_done_time is None:
                memory.workers_done_time = self.now
            waited = self.now - memory.workers_done_time
            if waited >= PS_DRAIN_SECONDS:
                self._finish("Succeeded", "Completed",
                             f"Every worker finished; the parameter servers still running after {PS_DRAIN_SECONDS:.0f} s "
                             "were stopped.")
                self.actions.stop += [n for n in self.names if n.startswith(("ps-", "standby-")) and n in self.replicas
                                      and n not in self.actions.stop]
                return
            self._requeue(PS_DRAIN_SECONDS - waited)
        if self.observed is None:
            problem = _problem(self.replicas, volume_pending)
            if problem:
                # A job that ran keeps its state (a replacement that waits), a new one stays Created.
                self.observed = Observed(self.before if self.before in ACTIVE else "Created", *problem)
                if not any(c.status == "True" and c.reason == problem[0] for c in self.status.conditions):
                    self.actions.events.append(("Warning", problem[0], problem[1]))  # once, when it begins
            elif any(r.phase == "Running" for r in self.replicas.values()):
                self.observed = Observed("Running", "Running", "The job's replicas are running.")
            elif self.before in ACTIVE:
                self.observed = Observed(self.before, self.before, "Replicas are being recreated.")
            else:
                self.observed = Observed("Created", "Created", "The job's objects are created; replicas are starting.")
        self.status.state = self.observed.state

    def _groups_done(self, phases: Mapping[str, str]) -> None:
        """A replica group of a fault-tolerant job finished and another did not (all finished: `_outcome`
        succeeds already). The groups commit every step together, so the job's training is over: those of
        the final quorum are writing their final checkpoint (a SIGTERM then changes nothing: they end
        with 0), and one that is still starting or rejoining (a replacement) has nothing left to train.
        The job succeeds; the groups still running are stopped."""
        done = sorted(n for n, p in phases.items() if p == "Succeeded")
        running = [n for n, p in phases.items() if p != "Succeeded" and n in self.replicas]
        self._finish("Succeeded", "Completed",
                     f"Replica group {done[0]} finished training; {', '.join(running)} "
                     f"{'was' if len(running) == 1 else 'were'} stopped with nothing left to train.")
        self.actions.stop += [n for n in running if n not in self.actions.stop]

    # -- the end of a round --------------------------------------------------------------

    def _requeue(self, seconds: float) -> None:
        seconds = max(0.1, seconds)
        current = self.actions.requeue_after
        self.actions.requeue_after = seconds if current is None else min(current, seconds)

    def _done(self, report: bool = True) -> Round:
        status = self.status
        status.selector = selector(self.job)  # the pods the scale subresource counts
        if report:
            status.observed_generation = self.job.metadata.generation
            status.workers = self.spec.world_size
            status.replicas = self.memory.size if self.memory.size is not None else self.spec.size
            status.replica_statuses = _counts(self.names, self.replicas, self.is_ddp)
            if self.observed is not None:
                status.state = self.observed.state
                status.conditions = conditions(status.conditions, self.observed, iso(self.now),
                                               self.job.metadata.generation)
            if status.state not in TERMINAL:
                self._requeue(self.safety_net)
        return Round(status, self.actions)

    def _final_progress(self) -> None:
        """At success, the chief's final results complete the progress that the last reading,
        up to a few seconds old, left behind."""
        head = self.replicas.get(chief(self.job))
        if (head is None or not head.final) and self.spec.fault_tolerant:
            # The chief's group was replaced and stopped before it finished: another group speaks.
            head = next((seen for name, seen in sorted(self.replicas.items())
                         if name.startswith("ddp-") and seen.final), head)
        final = head.final if head is not None else None
        if not final:
            return
        now = iso(self.now)
        progress = copy.deepcopy(self.status.progress) or Progress()
        step = final.get("global_step", final.get("steps"))
        if _finite(step):
            progress.step = int(step)
        if _finite(final.get("final_train_loss")):
            progress.loss = float(final["final_train_loss"])
        for name in ("eval_accuracy", "eval_loss", "eval_perplexity"):
            if _finite(final.get(name)):
                setattr(progress, name, float(final[name]))
        reported = final.get("metrics")
        if isinstance(reported, dict):
            merged = {**(progress.metrics or {}), **{str(k): float(v) for k, v in reported.items() if _finite(v)}}
            progress.metrics = dict(list(merged.items())[:MAX_REPORTED_METRICS])
        if isinstance(step, int):
            progress.total_steps = progress.total_steps if progress.total_steps is not None else step
            progress.eta_seconds = 0
            progress.update_time = now
            self.status.progress = progress
        # The newest checkpoint: the chief's own (Single, DDP) or the first shard's (ParameterServer).
        holder = self.replicas.get("ps-0") if self.spec.mode == "ParameterServer" else head
        held = (holder.final or {}) if holder is not None else {}
        if isinstance(held.get("checkpoint_step"), int) and held["checkpoint_step"] > 0:
            when = held.get("checkpoint_time")
            self.status.last_checkpoint = LastCheckpoint(
                held["checkpoint_step"], iso(when) if _finite(when) else now
            )


def interrupted(status: JobStatus, now: float) -> JobStatus:
    """The status of a job whose replicas were all stopped from outside (a local run
    interrupted): a suspended one, so the next round resumes it, its clocks paused and
    no replica taken for deleted."""
    out = copy.deepcopy(status)
    if out.state in TERMINAL:
        return out
    memory = out.memory
    if memory.active_since is not None:
        memory.active_seconds += max(0.0, now - memory.active_since)
        memory.active_since = None
    memory.pending_restarts = {}
    memory.identities = {}
    out.state = "Suspended"
    return out


def _listed(indices: range, role: str = "worker") -> str:
    """worker-1, worker-2 and worker-3."""
    names = [f"{role}-{i}" for i in indices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _finite(value: Any) -> bool:
    """A number the status can hold (JSON has no NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _released(seen: ReplicaObservation) -> bool:
    """A parameter-server worker that ps-0 released at a resize: it ended, neither failed nor succeeded.
    Only a worker (kubetrain's own loop) means that by 76: a user's script (a Single or DDP replica)
    exiting 76 has failed."""
    return seen.replica.startswith("worker-") and seen.phase in ("Succeeded", "Failed") \
        and seen.exit_code == EXIT_RELEASED


def _failure(seen: ReplicaObservation) -> policy.Failure | None:
    """A replica that stopped and must be dealt with; None while it is fine (or released: `_release`)."""
    if seen.terminating or seen.phase != "Failed" or _released(seen):
        return None
    if seen.reason == "Evicted":
        return policy.Failure(seen.replica, reason="Evicted")
    return policy.Failure(seen.replica, exit_code=seen.exit_code if seen.exit_code is not None else 1,
                          message=seen.message)


def _restarted_in_place(seen: ReplicaObservation) -> bool:
    """Running again by itself (a container restarted in place): nothing to stop or start. Never a
    replica on a lost node: the taint manager marks it (DisruptionTarget) a moment before it deletes
    it, and in that moment it still reads Running."""
    return seen.phase in ("Pending", "Running") and not seen.terminating and not seen.node_lost


def _succeeded(seen: ReplicaObservation | None, is_ddp: bool) -> bool:
    if seen is None:
        return False
    if seen.phase == "Succeeded":
        return True
    # A StatefulSet restarts even a container that exited 0; its resumed
    # trainer finds the final checkpoint and exits 0 again.
    return is_ddp and (seen.exit_code == 0 or (seen.last_exit_code == 0 and seen.phase != "Failed"))


def _counts(names: list[str], replicas: Mapping[str, ReplicaObservation], is_ddp: bool) -> dict[str, ReplicaCounts]:
    out: dict[str, ReplicaCounts] = {}
    for name in names:
        counts = out.setdefault(name.rsplit("-", 1)[0], ReplicaCounts())
        seen = replicas.get(name)
        if seen is None or _released(seen):
            continue  # a released worker that rejoins is neither: `_release`
        if _succeeded(seen, is_ddp):
            counts.succeeded += 1
        elif seen.phase == "Failed":
            counts.failed += 1
        elif seen.phase in ("Pending", "Running") and not seen.terminating:
            counts.active += 1
    return out


def _problem(replicas: Mapping[str, ReplicaObservation], volume_pending: list[str]) -> tuple[str, str] | None:
    for seen in replicas.values():
        if seen.waiting_reason in IMAGE_PULL_REASONS:
            return ("ImagePullFailed",
                    f"{seen.replica} cannot pull its image ({seen.waiting_reason}): {seen.waiting_message}".rstrip(": "))
    if volume_pending:
        return "VolumePending", f"PersistentVolumeClaim {', '.join(volume_pending)} is Pending: check the StorageClass."
    waiting = _unschedulable(replicas)
    if waiting:
        names = ", ".join(seen.replica for seen in waiting)
        return "Unschedulable", f"{names} cannot be scheduled: {waiting[0].unschedulable}"
    return None


def _unschedulable(replicas: Mapping[str, ReplicaObservation]) -> list[ReplicaObservation]:
    """The replicas the scheduler reports it cannot place, by name."""
    return sorted((seen for seen in replicas.values() if seen.unschedulable and seen.phase == "Pending"
                   and not seen.terminating), key=lambda seen: seen.replica)
