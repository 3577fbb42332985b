"""The job's side of a training process: its checkpoints and its progress, one implementation for all.

The built-in loops (Single, DDP, the parameter-server shard) and users' own
scripts (through `import kubetrain`) restore, save and report through these
two classes, so restarts, progress, metrics and faults behave the same for
both:

- `JobCheckpoints`: the newest valid checkpoint restored (agreed on across a
  DDP group: every rank gets the same one), saves written by one writer per
  job, every durable checkpoint reported to the metrics and the event log.
- `ProgressReporter`: the step and the values of one process turned into the
  catalogue's gauges, `train` events for the progress line and the summary,
  and the local fault injection (`--fault REPLICA:kill@step=N`).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from numbers import Real
from typing import Any

from kubetrain.api.identity import JobIdentity
from kubetrain.api.spec import MAX_REPORTED_METRICS

from .checkpoint import CheckpointInfo, CheckpointStore, Store
from .sharded import ShardedCheckpointError, ShardedStore, fill_template, has_dtensors
from .sharded import complete as sharded_complete
from .context import ReplicaContext
from .events import EventLog
from .metrics import TrainerMetrics, attach_metrics
from .object_checkpoints import (ObjectCheckpoints, ObjectCheckpointStore, ObjectShardedStore, Owner, claim, job_root,
                                 write_job)
from .objstore import parse_uri, shared_store

log = logging.getLogger(__name__)

# Values with a gauge of their own in the catalogue (and a place of their own in
# the job's status); every other reported value goes to `kubetrain_reported_metric`.
CATALOGUE_GAUGES = ("loss", "eval_accuracy", "eval_loss", "samples_per_second")
# Aim for about this many `train` events per run when the total is known; with
# no total, at most one event per this many seconds (a script may report every
# step of a long run: the event log must not grow by a line per step).
TRAIN_EVENTS_PER_RUN = 200
UNTIMED_EVENT_SECONDS = 1.0


class JobCheckpoints:
    """One process's view of the job's checkpoints.

    `reader`: this process reads the checkpoint directory (in DDP the first
    rank of each node: ranks of one node share its volume, and only one may
    set a corrupt file aside). `writer`: this process writes (global rank 0 in
    DDP: every rank may call `save`, exactly one writes). `background` (the
    built-in loops and `kubetrain.save`): saves return after the copy into
    memory and are written, verified and made durable by a writer thread, at
    most one at a time; False makes every save durable when it returns.
    Metrics and the `checkpoint` event report a checkpoint only once it is
    durable and verified.

    A state holding DTensors (a sharded model) takes the sharded path
    instead (sharded.py): every rank writes its own shards, so every rank must
    call `save`, and the directory must be one that every rank of the job
    reads: `nodes` (the DDP nodes of the group) is 1, or the job's
    checkpoint.storage.accessMode is ReadWriteMany (one claim for every node).
    """

    def __init__(self, ctx: ReplicaContext, metrics: TrainerMetrics, events: EventLog, *,
                 reader: bool = True, writer: bool = True, background: bool = True, nodes: int = 1):
        self.ctx, self.metrics, self.events = ctx, metrics, events
        self.reader, self.writer, self.nodes = reader, writer, nodes  # this rank's part in the job's checkpoints
        self.sharded: ShardedStore | None = None
        """The job's sharded checkpoints, made at the first sharded save or restore (on every rank)."""
        self.identity = JobIdentity.of(ctx.spec)
        """What every checkpoint of this job records of it, and what a checkpoint must match to be resumed."""
        self.uri = parse_uri(ctx.checkpoint_uri, "KUBETRAIN_CHECKPOINT_URI") if ctx.checkpoint_uri else None
        """The replica's prefix in object storage (spec.checkpoint.storage.uri), or None: a volume."""
        if self.uri is not None:
            attach_metrics(shared_store(), metrics)
            shared_store().check_bucket(self.uri, "checkpoints")
            # Before anything under the URI is read for a restore or cleaned: another job's prefix is refused
            # untouched, and the first writer records this job as its owner.
            claim(job_root(self.uri), Owner(ctx.namespace, ctx.job_name), self.identity, writer)
        self.store: CheckpointStore | None = None
        if reader or writer:
            if self.uri is not None:
                self.store = ObjectCheckpointStore(
                    ctx.checkpoint_dir, self.uri, ctx.spec.checkpoint.keep_last, self.identity,
                    background=background, on_persisted=self._persisted, mid_save=ctx.maybe_fault_in_save,
                    on_upload=metrics.checkpoint_upload_seconds.observe, writer=writer)
            else:
                self.store = CheckpointStore(ctx.checkpoint_dir, ctx.spec.checkpoint.keep_last, self.identity,
                                             background=background, on_persisted=self._persisted,
                                             mid_save=ctx.maybe_fault_in_save)
        if writer and self.uri is not None and ctx.job_file is not None:
            # What `kubetrain checkpoints export s3://...` reads to know the job (a Single or DDP model, the
            # parameter server's shards, a script's state).
            write_job(job_root(self.uri), ctx.job_file.read_bytes())
        self.step = -1
        """Step of the last checkpoint saved (maybe still being written) or restored by this process; -1: none."""

    def load_local(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint in this process's own directory."""
        if self.store is None:
            return None
        try:
            return self.store.load_latest()
        finally:
            self._report_set_aside(self.store)

    def _report_set_aside(self, store: Store) -> None:
        """Each checkpoint the restore set aside, as an event and a count: which, and why."""
        for checkpoint, reason in store.set_aside_log:
            self.metrics.checkpoints_set_aside_total.inc()
            self.events.write("checkpoint_set_aside", checkpoint=checkpoint, reason=reason)
        store.set_aside_log.clear()

    @property
    def shared(self) -> bool:
        """Whether every rank of the job reads and writes this same directory (a sharded checkpoint needs it)."""
        return (self.nodes == 1 or self.ctx.spec.checkpoint.storage.access_mode == "ReadWriteMany"
                or self.uri is not None)

    def restore(self, group: Any = None, world_size: int = 1, rank: int = 0,
                found: tuple[int, dict[str, Any]] | None = None,
                template: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], int | None] | None:
        """(step, state, source rank) of the newest valid checkpoint of the job, or None.

        Alone (world_size 1) that is this directory's newest. In a DDP group
        (`group` is torch.distributed's, already initialised) every node's
        reader offers the step it holds, the group takes the newest (the lowest
        rank among equals) and its holder broadcasts the state: only the volume
        of the node that held rank 0 needs the files, and a rank 0 that lands on
        another node after a restart loses nothing. `found` is what this
        process read before joining the group (`load_local`), if it did.

        A sharded checkpoint (sharded.py) newer than every plain one is loaded
        into `template` in place (source rank None), each rank reading only its
        own pieces; without a template that is a ShardedCheckpointError. A
        plain checkpoint with a template is copied into it (a sharded template
        takes its shards of the whole tensors). Collective in a group: every
        rank calls it.
        """
        if found is None and world_size == 1:
            found = self.load_local()
        offer = (found[0] if found is not None else None, self._sharded_seen())
        offers: list[Any] = [offer]
        if world_size > 1:
            import torch.distributed as dist

            offers = [None] * world_size
            dist.all_gather_object(offers, offer, group=group)
        if any(seen is not None for _, seen in offers):
            loaded = self._restore_sharded(template, max(p for p, _ in offers if p is not None)
                                           if any(p is not None for p, _ in offers) else None)
            if loaded is not None:
                return loaded
        held = [(step, r) for r, (step, _) in enumerate(offers) if step is not None]
        if not held:
            return None
        step, source = max(held, key=lambda sr: (sr[0], -sr[1]))
        if world_size > 1:
            import torch.distributed as dist

            box: list[Any] = [found[1] if rank == source and found is not None else None]
            dist.broadcast_object_list(box, src=source, group=group)
            found = (step, box[0])
        assert found is not None
        state = found[1] if template is None else fill_template(template, found[1])
        self.step = found[0]
        self.events.write("resume", step=found[0], source_rank=source)
        return found[0], state, source

    def _sharded_seen(self) -> int | None:
        """Step of the newest complete sharded checkpoint in this process's directory (not yet verified)."""
        if not self.reader:
            return None
        if self.uri is not None:
            return ObjectCheckpoints(self.uri).newest_step(sharded=True)
        found = sharded_complete(self.ctx.checkpoint_dir)
        return found[-1][0] if found else None

    def _restore_sharded(self, template: dict[str, Any] | None,
                         plain_step: int | None) -> tuple[int, dict[str, Any], None] | None:
        """The newest sharded checkpoint loaded into `template` when it is newer than `plain_step`, else None."""
        if not self.shared:
            raise ShardedCheckpointError(self._not_shared("restore"))
        store = self._sharded_store()
        try:
            while True:
                newest = store.newest()
                if newest is None or (plain_step is not None and plain_step >= newest[0]):
                    return None
                step, path = newest
                if template is None:
                    raise ShardedCheckpointError(
                        f"kubetrain.restore: the newest checkpoint (step {step}, {path.name}) is sharded: pass a "
                        "template to load it into, of the structure saved, e.g. kubetrain.restore({'model': "
                        "model_sd, 'optimizer': optim_sd}) with get_state_dict(model, optimizer) of the freshly "
                        "built, sharded model"
                    )
                if store.load_or_set_aside(path, template):
                    break
        finally:
            self._report_set_aside(store)
        self.step = step
        self.events.write("resume", step=step, source_rank=None, sharded=True, path=str(path))
        return step, template, None

    def _sharded_store(self) -> ShardedStore:
        if self.sharded is None:
            timeout = timedelta(seconds=self.ctx.spec.run_policy.progress_deadline_seconds)
            if self.uri is not None:
                self.sharded = ObjectShardedStore(
                    self.ctx.checkpoint_dir, self.uri, self.ctx.spec.checkpoint.keep_last, self.identity,
                    timeout=timeout, on_persisted=self._persisted, mid_save=self.ctx.maybe_fault_in_save,
                    on_upload=self.metrics.checkpoint_upload_seconds.observe)
            else:
                self.sharded = ShardedStore(
                    self.ctx.checkpoint_dir, self.ctx.spec.checkpoint.keep_last, self.identity,
                    timeout=timeout, on_persisted=self._persisted, mid_save=self.ctx.maybe_fault_in_save,
                )
        return self.sharded

    def _not_shared(self, call: str) -> str:
        return (f"kubetrain.{call}: a sharded state (DTensors) is written by every rank into one directory that "
                f"every rank reads, but this job's {self.nodes} nodes each have a checkpoint volume of their own: "
                "set spec.checkpoint.storage.accessMode: ReadWriteMany (one claim that every node mounts)")

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint `state` as step `step`.

        A plain state: the writer only writes it, the others note the step. A
        sharded one (DTensors): every rank must call, each writes its shards.
        """
        if has_dtensors(state):
            if not self.shared:
                raise ShardedCheckpointError(self._not_shared("save"))
            if self.store is not None:
                self.store.wait()  # at most one save in flight, of either kind
            sharded = self._sharded_store()
            sharded.save(step, state)
            self.metrics.checkpoint_stall_seconds.observe(sharded.stall_seconds)
        elif self.writer:
            assert self.store is not None
            if self.sharded is not None:
                self.sharded.wait()
            self.store.save(step, state)
            self.metrics.checkpoint_stall_seconds.observe(self.store.stall_seconds)
        self.step = step

    @property
    def durable_step(self) -> int | None:
        """Step of the newest plain checkpoint this process wrote and verified, or restored; None: none yet."""
        return self.store.durable_step if self.store is not None else None

    def wait(self) -> None:
        """The last save is durable on return (TransientError if it failed)."""
        if self.sharded is not None:
            self.sharded.wait()
        if self.writer and self.store is not None:
            self.store.wait()

    def _persisted(self, info: CheckpointInfo, seconds: float) -> None:
        self.metrics.checkpoint_duration_seconds.observe(seconds)
        self.metrics.checkpoint_size_bytes.set(info.bytes)
        self.metrics.checkpoint_last_success_timestamp_seconds.set_to_current_time()
        self.metrics.last_checkpoint_step.set(info.step)
        where = {"uri": info.uri} if info.uri else {}
        self.events.write("checkpoint", step=info.step, path=str(info.path), seconds=seconds, bytes=info.bytes,
                          **where)


class ProgressReporter:
    """The progress of one process: gauges, `train` events and the fault injection, from `report` calls."""

    def __init__(self, ctx: ReplicaContext, metrics: TrainerMetrics, events: EventLog,
                 total_steps: int | None = None):
        self.ctx = ctx
        self.metrics = metrics
        self.events = events
        self.total_steps: int | None = None
        self.step = 0
        self.values: dict[str, float] = {}
        """The last value reported under each name."""
        self._named: set[str] = set()
        self._warned_names = False
        self._window_step: int | None = None
        self._window_samples = 0
        self._window_start = time.perf_counter()
        self._last_event = -math.inf
        if total_steps is not None:
            self.set_total(total_steps)

    def set_total(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.metrics.total_steps.set(total_steps)

    def start_window(self, step: int) -> None:
        """Rates are measured from here (a resumed process: from its first step), and the process's step is the
        one it resumed from: its gauge never reads 0 between a restart and the first step (a dashboard's dip,
        a report's curve going back past the checkpoint)."""
        self.step = step
        self.metrics.training_step.set(step)
        self._window_step, self._window_samples, self._window_start = step, 0, time.perf_counter()

    def report(self, step: int, total_steps: int | None = None, samples: int = 0,
               event_fields: dict[str, Any] | None = None, **values: float) -> None:
        """This process reached `step`; `values` are its numbers at that step (loss, ...).

        `samples` (the batch's samples, for the built-in loops) feeds the
        samples-per-second figure; a script that knows its own throughput
        reports `samples_per_second`. The fault injection fires here, after
        the step and before its checkpoint: a crash there loses the step.
        """
        if total_steps is not None and total_steps != self.total_steps:
            self.set_total(total_steps)
        if self._window_step is None:
            self.start_window(max(0, step - 1))
        if step > self.step:
            self.metrics.steps_total.inc(step - self.step)
        if samples:
            self.metrics.samples_total.inc(samples)
            self._window_samples += samples
        self.step = step
        self.metrics.training_step.set(step)
        for name, value in values.items():
            self._record(name, value)
        if self._event_due(step):
            self._write_event(step, event_fields or {})
        self.ctx.maybe_fault(step)

    def _record(self, name: str, value: float) -> None:
        self.values[name] = value
        if name in CATALOGUE_GAUGES:
            getattr(self.metrics, name).set(value)
        elif name in self._named or len(self._named) < MAX_REPORTED_METRICS:
            self._named.add(name)
            self.metrics.reported_metric.labels(name=name).set(value)
        elif not self._warned_names:
            self._warned_names = True
            log.warning("%s: kubetrain.report: more than %d metric names; %r and later new names go to the "
                        "event log only, not to /metrics", self.ctx.replica, MAX_REPORTED_METRICS, name)

    def _event_due(self, step: int) -> bool:
        if self.total_steps:
            every = max(1, self.total_steps // TRAIN_EVENTS_PER_RUN)
            return step % every == 0 or step >= self.total_steps
        return time.perf_counter() - self._last_event >= UNTIMED_EVENT_SECONDS

    def _write_event(self, step: int, extra: dict[str, Any]) -> None:
        now = time.perf_counter()
        seconds = max(now - self._window_start, 1e-9)
        steps = step - (self._window_step or 0)
        if steps > 0:
            self.metrics.steps_per_second.set(steps / seconds)
        fields: dict[str, Any] = {"step": step, **self.values, **extra}
        if self._window_samples:
            rate = self._window_samples / seconds
            self.metrics.samples_per_second.set(rate)
            fields["samples_per_second"] = rate
        if steps > 0:
            fields["steps_per_second"] = steps / seconds
        if self.total_steps:
            fields["total_steps"] = self.total_steps
        self.events.write("train", **fields)
        self._last_event = now
        self._window_step, self._window_samples, self._window_start = step, 0, now

    def flush(self) -> None:
        """Write the last reported step as an event if it was not (the end of a script)."""
        if self._window_step is not None and self.step != self._window_step:
            self._write_event(self.step, {})


def number(name: str, value: Any) -> float:
    """A reported value as a float: Python numbers, numpy scalars and one-element tensors."""
    if isinstance(value, bool):
        raise TypeError(f"kubetrain.report: {name}={value!r} is a bool; report numbers")
    if isinstance(value, Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            result = item()
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"kubetrain.report: {name} must be a number or a one-element tensor: {err}") from None
        if isinstance(result, Real) and not isinstance(result, bool):
            return float(result)
    raise TypeError(f"kubetrain.report: {name} must be a number, got {type(value).__name__}")
