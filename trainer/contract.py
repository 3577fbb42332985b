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
from numbers import Real
from typing import Any

from kubetrain_operator.api.spec import MAX_REPORTED_METRICS

from .checkpoint import CheckpointInfo, CheckpointStore, spec_hash
from .context import ReplicaContext
from .events import EventLog
from .metrics import TrainerMetrics

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
    """

    def __init__(self, ctx: ReplicaContext, metrics: TrainerMetrics, events: EventLog, *,
                 reader: bool = True, writer: bool = True, background: bool = True):
        self.ctx = ctx
        self.metrics = metrics
        self.events = events
        self.writer = writer
        self.store = (
            CheckpointStore(ctx.checkpoint_dir, ctx.spec.checkpoint.keep_last, spec_hash(ctx.spec),
                            background=background, on_persisted=self._persisted)
            if reader or writer else None
        )
        self.step = -1
        """Step of the last checkpoint saved (maybe still being written) or restored by this process; -1: none."""

    def load_local(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint in this process's own directory."""
        return self.store.load_latest() if self.store is not None else None

    def restore(self, group: Any = None, world_size: int = 1, rank: int = 0,
                found: tuple[int, dict[str, Any]] | None = None) -> tuple[int, dict[str, Any], int] | None:
        """(step, state, source rank) of the newest valid checkpoint of the job, or None.

        Alone (world_size 1) that is this directory's newest. In a DDP group
        (`group` is torch.distributed's, already initialised) every node's
        reader offers the step it holds, the group takes the newest (the lowest
        rank among equals) and its holder broadcasts the state: only the volume
        of the node that held rank 0 needs the files, and a rank 0 that lands on
        another node after a restart loses nothing. `found` is what this
        process read before joining the group (`load_local`), if it did.
        """
        if found is None and world_size == 1:
            found = self.load_local()
        if world_size > 1:
            import torch.distributed as dist

            offers: list[int | None] = [None] * world_size
            dist.all_gather_object(offers, found[0] if found is not None else None, group=group)
            held = [(step, r) for r, step in enumerate(offers) if step is not None]
            if not held:
                return None
            step, source = max(held, key=lambda sr: (sr[0], -sr[1]))
            box = [found[1] if rank == source and found is not None else None]
            dist.broadcast_object_list(box, src=source, group=group)
            found, state_source = (step, box[0]), source
        else:
            state_source = rank
        if found is None:
            return None
        self.step = found[0]
        self.events.write("resume", step=found[0], source_rank=state_source)
        return found[0], found[1], state_source

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint `state` as step `step` (the writer only; others note the step)."""
        if self.writer:
            assert self.store is not None
            self.store.save(step, state)
            self.metrics.checkpoint_stall_seconds.observe(self.store.stall_seconds)
        self.step = step

    def wait(self) -> None:
        """The last save is durable on return (TransientError if it failed)."""
        if self.writer and self.store is not None:
            self.store.wait()

    def _persisted(self, info: CheckpointInfo, seconds: float) -> None:
        self.metrics.checkpoint_duration_seconds.observe(seconds)
        self.metrics.checkpoint_size_bytes.set(info.bytes)
        self.metrics.checkpoint_last_success_timestamp_seconds.set_to_current_time()
        self.metrics.last_checkpoint_step.set(info.step)
        self.events.write("checkpoint", step=info.step, path=str(info.path), seconds=seconds, bytes=info.bytes)


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
        """Rates are measured from here (a resumed process: from its first step)."""
        self.step = step
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
