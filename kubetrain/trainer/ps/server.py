"""One parameter-server shard: its parameters, their optimizer, Sync or Async aggregation, checkpoints.

Where the optimizer runs, and why: on the shard, for the shard's parameters.
Optimizer state (momentum, Adam's moments) is as large as the parameters and
changes with every update; kept beside them it never travels, it is
checkpointed atomically with them in one file per shard, and it is sharded
for free. Workers stay stateless: they pull parameters, compute a gradient,
push it. A restarted worker therefore loses nothing but the step it was
computing, and any number of workers may come and go without the update
rule changing.

Aggregation:
- Sync: a step is one update with the average of the gradients every live
  worker pushed for it. A worker that has not pushed syncTimeoutSeconds after
  the step's first gradient arrived is dropped from that step (counted), and
  a worker silent that long is not waited for in later steps until it calls
  again. Workers wait for the next step in Pull (`min_step`).
- Async: each gradient is applied when it arrives; its staleness (updates
  since the parameters it was computed on) is recorded. A worker more than
  maxStaleness of its own steps ahead of the slowest live worker is held in
  Pull until the others catch up.

Elastic jobs, live (docs/scheduling.md#elastic-jobs): ps-0 reads the job's
size from its job file (SIZE_POLL_SECONDS). When it changes, ps-0 holds every
worker's next pull until none holds a batch it has not pushed (the cut: in
Sync, at the step boundary), deals the rest of the epoch again among the new
set (coordinator.resize), makes that durable, and answers the held pulls
with the new membership: the workers register again for their new cursors,
the ones past the size are released and leave, new ones join. A Sync step
then waits for the new set (STARTUP_GRACE_SECONDS for a joiner); Async does
not hold anyone for a joiner that has not called yet. The other shards learn
the new set from the first call that names it. A call naming another set
than the shard's is refused (FAILED_PRECONDITION, reason `membership`).

Pulls: the parameters whole, or, with a lossy compression algorithm, the
change since the copy the worker holds, which the shard keeps per worker
(compression.PullCompressor; docs/parameter-server.md, Compressed pulls).

Bad input on the wire (a wrong token, unknown tensors, wrong dtypes or
shapes, truncated or oversized chunks, steps from the future) is refused with
a gRPC status before anything changes: a push is received and checked whole
before it touches the parameters. Beyond well-formed, a shard refuses what
would corrupt the model or the job (docs/parameter-server.md):

- a gradient with a NaN or an Inf (checked after decoding, whatever the codec):
  INVALID_ARGUMENT naming the tensor, nothing applied, counted;
- a second push of one (worker, worker_step), whatever the worker's
  incarnation: acknowledged as DUPLICATE, not applied, counted (TakenSteps);
- a Finish from a worker whose pushes have not reached the end of its
  planned steps while training is not over, or from another process than the
  one that made its latest push: FAILED_PRECONDITION;
- a stream that stalls: a push silent for PUSH_STALL_SECONDS, or any stream
  older than the longest deadline an honest worker gives it, is cancelled.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from kubetrain.api.spec import Compression

from ..compression import MAX_WORKER_COPY_BYTES, PullCompressor, as_bytes
from ..session import JobCheckpoints
from ..metrics import TrainerMetrics
from ..preload import optimizer_step
from . import ps_pb2 as pb
from . import ps_pb2_grpc
from .psclient import wait_timeout
from .coordinator import MAX_WORKERS, Coordinator
from .transport import (
    GRPC_OPTIONS,
    MEMBERSHIP,
    NON_FINITE,
    REFUSAL_KEY,
    Assembler,
    ByteCounter,
    Expected,
    OutTensor,
    TokenInterceptor,
    WireError,
    WireFrame,
    decode_frame,
    dtype_name,
    encode_frame,
    first_non_finite,
    frames_for,
    invalid,
)

log = logging.getLogger(__name__)

SERVICE = "kubetrain.ps.v1.ParameterShard"
# How often waiting calls and the Sync timer look at the clock again.
TICK_SECONDS = 0.05
# A worker not heard from since this shard started is still importing torch,
# not silent, for this long: Sync waits for it (syncTimeoutSeconds per step at
# most), Async holds the others for it. One that never comes is dropped after.
STARTUP_GRACE_SECONDS = 60.0
# A push stream silent this long between two frames is stalled, and cancelled.
# A frame is at most MAX_MESSAGE_BYTES (5 MiB): even at 10 MB/s it arrives in
# half a second, so 10 s of silence is a client that stopped sending (hung,
# paused, or hostile), not a slow one. Until then the stream holds one server
# thread, nothing else: it never holds the shard's lock or its worker's buffers
# against another push (a concurrent push of the same worker gets fresh ones).
PUSH_STALL_SECONDS = 10.0
# Any stream (Pull, Push) this much older than the longest deadline an honest
# worker gives its calls (client.wait_timeout) was abandoned by its caller or
# has no deadline at all (a hand-made client): the shard cancels it, so no
# caller holds a server thread longer than an honest one could.
STREAM_GRACE_SECONDS = 5.0
# How many of each worker's pushes a shard remembers exactly (TakenSteps).
# An honest worker's pushes to a shard only go forward (it waits for each
# reply, and a restarted worker resumes after the last step ps-0 recorded,
# with ps-0's checkpoint), so everything at or below the remembered window
# counts as taken. The window is there for pushes out of order, a buggy or
# hostile client's far-future steps: up to this many sit beside the honest
# sequence without raising the floor past it. Memory: about 100 bytes per
# entry, 6.4 KB per worker, 6.5 MB for the largest job (1024 workers).
DEDUP_WINDOW_STEPS = 64
# How often ps-0 reads the job's size from its job file (an elastic job: kubectl scale rewrites the
# job's ConfigMap, kubetrain scale the run's job.yaml). A small file; a resize is seen within this.
SIZE_POLL_SECONDS = 1.0


class TakenSteps:
    """The worker_steps of one worker this shard has taken a push for: each is taken once.

    Exact for the last DEDUP_WINDOW_STEPS steps taken; a step at or below
    `floor` (the highest step evicted from the window) counts as taken, so a
    replay is never applied twice however old it is. Evicting the smallest
    step first keeps a few far-future steps from lifting the floor over the
    worker's honest sequence.
    """

    def __init__(self, window: int = DEDUP_WINDOW_STEPS, floor: int = 0, steps: list[int] | None = None):
        self.window = window
        self.floor = floor
        self._steps: set[int] = set()
        self._heap: list[int] = []
        for step in steps or ():
            self.add(step)

    def __contains__(self, step: int) -> bool:
        return step <= self.floor or step in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int) -> None:
        if step in self:
            return
        self._steps.add(step)
        heapq.heappush(self._heap, step)
        while len(self._heap) > self.window:
            evicted = heapq.heappop(self._heap)
            self._steps.discard(evicted)
            self.floor = max(self.floor, evicted)

    def state_dict(self) -> dict[str, Any]:
        return {"floor": self.floor, "steps": sorted(self._steps)}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, window: int = DEDUP_WINDOW_STEPS) -> "TakenSteps":
        state = state or {}
        return cls(window, state.get("floor", 0), state.get("steps", []))


@dataclass
class WorkerState:
    last_contact: float | None = None
    """None until the worker first calls: a worker still starting up is not silent."""
    worker_step: int = 0
    finished: bool = False
    done_pushing: bool = False
    progress: int = 0
    """The highest worker_step this worker pushed (any outcome, gradient or not): what Finish is checked against."""
    incarnation: int = 0
    """The incarnation of its latest push: only that process may finish it. Not persisted: after a
    restart the worker reports its progress once more (worker.py, _finish_shard)."""
    taken: TakenSteps = field(default_factory=TakenSteps)
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    receive_lock: threading.Lock = field(default_factory=threading.Lock)
    pull_lock: threading.Lock = field(default_factory=threading.Lock)
    """One compressed pull of this worker at a time: each one reads and replaces its copy (PullCompressor)."""
    since: float | None = None
    """When a resize made it one of the job's workers; None: one since the shard started."""


@dataclass(eq=False)
class StreamWatch:
    """A stream in progress, as the shard's watchdog (ParameterShard.tick) sees it."""

    kind: str
    worker: int
    context: grpc.ServicerContext
    started: float
    last_message: float
    stall_seconds: float | None
    """None: the stream may be silent (a Pull waiting for a step); only its age counts."""
    cancelled: bool = False


@dataclass
class ShardConfig:
    """What a shard needs to know of the job, taken from the spec."""

    replica: str
    workers: int
    aggregation: str
    sync_timeout: float
    max_staleness: int
    max_steps: int | None
    interval_steps: int
    chunk_bytes: int
    worker_steps: int | None = None
    """Steps each worker runs (epochs x steps per epoch); None with maxSteps, where the shard's step ends training."""
    push_stall_seconds: float = PUSH_STALL_SECONDS
    stream_seconds: float | None = None
    """Age at which any stream is cancelled; None: the longest honest deadline plus STREAM_GRACE_SECONDS."""
    compression: Compression = field(default_factory=Compression)
    """The job's algorithm: with a lossy one, pulls carry the change since the worker's copy (PullCompressor)."""
    worker_copy_bytes: int = MAX_WORKER_COPY_BYTES
    """What this shard may hold of workers' copies for compressed pulls (compression.MAX_WORKER_COPY_BYTES)."""
    worker_steps_for: Callable[[int], int | None] | None = None
    """worker_steps at another number of workers (an elastic job's resize); None: the job is never resized."""
    size_source: Callable[[], int | None] | None = None
    """ps-0: the job's size as its job file says now (None: unreadable, keep the current one)."""

    def __post_init__(self) -> None:
        if self.stream_seconds is None:
            self.stream_seconds = wait_timeout(self.sync_timeout) + STREAM_GRACE_SECONDS


class ParameterShard:
    """The state of one shard and the handlers of its RPCs (the ParameterShard service)."""

    def __init__(
        self,
        config: ShardConfig,
        params: Mapping[str, torch.Tensor],
        optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        store: JobCheckpoints,
        coordinator: Coordinator | None = None,
        metrics: TrainerMetrics | None = None,
        after_step: Callable[[int], None] = lambda step: None,
        clock: Callable[[], float] = time.monotonic,
        after_resize: Callable[[int, int, int], None] = lambda step, workers, membership: None,
    ):
        self.config = config
        self.params = {n: torch.nn.Parameter(t.detach().clone(), requires_grad=True) for n, t in params.items()}
        self.expected = {n: Expected.of(p) for n, p in self.params.items()}
        self.optimizer = optimizer_factory(list(self.params.values()))
        self.store, self.coordinator, self.metrics = store, coordinator, metrics
        self.after_step, self.after_resize, self.clock = after_step, after_resize, clock  # the owner's hooks
        self.counter = ByteCounter(metrics)
        self.raw_gradient_bytes = 0
        self.compressed_gradient_bytes = 0
        self.cond = threading.Condition()
        self.incarnation = random.getrandbits(63) or 1
        self.step = 0
        self.dropped_total = 0
        self.checkpoint_step = -1
        self.started = clock()
        self.workers = {w: WorkerState() for w in range(config.workers)}
        self.membership = coordinator.membership if coordinator is not None else 0
        """The set of workers this shard serves (coordinator.py); the other shards take it from calls."""
        self.target_size: int | None = None
        """ps-0: the size the job file asks for, while it differs from the current set's."""
        self.waiting: dict[int, int] = {}
        """ps-0: pulls waiting, per worker: a worker waiting here has pushed all it computed (the cut)."""
        self.size_checked = clock()
        self.pending: set[int] = set()
        """Sync: workers counted in the current step (with a gradient, or a push without one)."""
        self.contributors = 0
        """Sync: gradients summed in pending_sum for the current step."""
        self.pending_sum = {n: torch.zeros_like(p) for n, p in self.params.items()}
        shard_bytes = sum(e.nbytes for e in self.expected.values())
        self.pulls = PullCompressor(config.compression, shard_bytes, config.worker_copy_bytes)
        self.first_push_at: float | None = None
        self.job_finished = threading.Event()
        self.streams: set[StreamWatch] = set()
        self.streams_lock = threading.Lock()
        self._publish()

    # --- state -------------------------------------------------------------------

    def _publish(self) -> None:
        """Freeze the parameters pulls serve: every pull sees exactly one step's parameters."""
        self.published = (self.step, {n: p.detach().clone() for n, p in self.params.items()})

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": {n: p.detach() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            # What was taken travels with the parameters it went into: a shard
            # restored to this step takes again exactly what the checkpoint lacks.
            "workers": {
                w: {"finished": s.finished, "worker_step": s.worker_step, "progress": s.progress,
                    "taken": s.taken.state_dict()}
                for w, s in self.workers.items()
            },
            "coordinator": self.coordinator.state_dict() if self.coordinator else {},
            "dropped_total": self.dropped_total,
            "membership": self.membership,
        }

    def restore(self) -> bool:
        """Resume from the newest valid checkpoint; True when there was one."""
        found = self.store.load_local()
        if found is None:
            return False
        step, state = found
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        resized = len(state["workers"]) != self.config.workers
        for w, saved in state["workers"].items():
            if resized:
                # An elastic job's new set of workers: their cursors are dealt again (the coordinator),
                # their steps counted afresh, so nothing of the old set's record applies.
                break
            worker = self.workers[int(w)]
            worker.finished = saved["finished"]
            worker.worker_step = saved["worker_step"]
            # Checkpoints from before progress and taken steps were kept: the
            # worker's step is the best record of both.
            worker.progress = saved.get("progress", saved["worker_step"])
            worker.taken = TakenSteps.from_state(saved.get("taken", {"floor": saved["worker_step"]}))
        if self.coordinator is not None:
            self.coordinator.load_state_dict(state["coordinator"])
            self.membership = self.coordinator.membership
        elif not resized:
            # The set its checkpoint served (0 from before live resizes: taken from the first call).
            self.membership = state.get("membership", 0)
        if resized:
            log.info("%s: resumed at step %d with %d workers (the checkpoint had %d)", self.config.replica, step,
                     self.config.workers, len(state["workers"]))
        self.step = step
        self.dropped_total = state["dropped_total"]
        self.checkpoint_step = step
        self._publish()
        return True

    def checkpoint(self, wait: bool = False) -> None:
        """Save under the lock (the caller holds it): parameters, optimizer and cursors of one step."""
        self.store.save(self.step, self.state())  # the job's checkpoints: they observe the stall
        self.checkpoint_step = self.step
        if wait:
            self.store.wait()

    @property
    def done(self) -> bool:
        max_steps = self.config.max_steps
        return (max_steps is not None and self.step >= max_steps) or self.job_finished.is_set()

    # --- aggregation (all under self.cond) ------------------------------------------------

    def _touch(self, worker: int) -> WorkerState:
        """The worker's state, its contact now; one a resize released gets a state of its own, not kept."""
        state = self.workers.get(worker) or WorkerState()
        state.last_contact = self.clock()
        return state

    def _alive(self, state: WorkerState) -> bool:
        """Heard from within syncTimeoutSeconds; one not heard from yet is starting up, for a while."""
        now = self.clock()
        if state.last_contact is None:
            since = self.started if state.since is None else state.since
            return now - since < max(self.config.sync_timeout, STARTUP_GRACE_SECONDS)
        return now - state.last_contact < self.config.sync_timeout

    def _expected_workers(self) -> set[int]:
        """Workers a Sync step waits for: alive, and neither finished nor done pushing."""
        return {w for w, s in self.workers.items() if not s.finished and not s.done_pushing and self._alive(s)}

    def _apply(self, grads: dict[str, torch.Tensor] | None, scale: float = 1.0) -> None:
        """One step: an update with `grads` (times `scale`), or with None a step without one."""
        if grads is not None:
            for name, param in self.params.items():
                param.grad = grads[name] if scale == 1.0 else grads[name] * scale
            optimizer_step(self.optimizer)  # a restored shard: not waiting for torch._dynamo (preload.py)
            for param in self.params.values():
                param.grad = None
        self.step += 1
        self._publish()
        if self.metrics:
            self.metrics.steps_total.inc()
            self.metrics.training_step.set(self.step)
        self.cond.notify_all()
        # After the update, before any checkpoint of this step: a fault here loses it.
        self.after_step(self.step)
        if self.step % self.config.interval_steps == 0:
            self.checkpoint()

    def maybe_complete_sync_step(self) -> None:
        """Apply the pending average once every expected worker pushed, or the step timed out."""
        if not self.pending or self.config.aggregation != "Sync":
            return
        missing = self._expected_workers() - self.pending
        started = self.first_push_at
        assert started is not None  # set by the step's first push, and a push is pending
        if missing and self.clock() - started < self.config.sync_timeout:
            return
        if missing:
            self.dropped_total += len(missing)
            if self.metrics:
                self.metrics.sync_dropped_workers_total.inc(len(missing))
            log.warning("%s: step %d: dropped silent workers %s", self.config.replica, self.step, sorted(missing))
        if self.contributors:
            self._apply(self.pending_sum, 1.0 / self.contributors)
        else:
            # Every worker counted in had no finite gradient: the step passes
            # without an update, so the workers waiting for it go on.
            log.warning("%s: step %d: no finite gradient from any worker; no update", self.config.replica, self.step)
            self._apply(None)
        self.pending.clear()
        self.contributors = 0
        for buffer in self.pending_sum.values():
            buffer.zero_()
        self.first_push_at = None

    # --- elastic membership (all under self.cond) -----------------------------------------

    def _check_membership(self, membership: int, world_size: int) -> None:
        """A call names its worker's set of workers: the shard's own, or (not ps-0) a newer one it takes.

        0 is a call that names none (a progress report, a client of before live resizes): not checked.
        """
        if not membership or membership == self.membership:
            return
        if self.coordinator is None and membership > self.membership:
            if not self.membership and world_size == self.config.workers:
                self.membership = membership  # the set this shard started with: nothing to change
                return
            if not 1 <= world_size <= MAX_WORKERS:
                raise invalid(f"membership {membership} names {world_size} workers; a job has 1 to {MAX_WORKERS}")
            self._set_size(world_size, membership)
            return
        raise WireError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the job's workers changed (membership {self.membership} on {self.config.replica}, the call's "
            f"{membership}): register again",
            reason=MEMBERSHIP,
        )

    def _set_size(self, workers: int, membership: int) -> None:
        """Serve a new set of workers: every one starts afresh (its steps are counted again from its new
        cursor), the ones past the size are forgotten (and their copies for compressed pulls)."""
        now = self.clock()
        old = self.config.workers
        self.config.workers = workers
        self.membership = membership
        if self.config.worker_steps_for is not None:
            self.config.worker_steps = self.config.worker_steps_for(workers)
        for w in [w for w in self.workers if w >= workers]:
            self.pulls.forget(w)
        self.workers = {w: WorkerState(since=now) for w in range(workers)}
        self.pending.clear()
        self.contributors = 0
        for buffer in self.pending_sum.values():
            buffer.zero_()
        self.first_push_at = None
        if self.metrics:
            self.metrics.ps_workers.set(workers)
        log.info("%s: membership %d, %d workers (was %d) from step %d", self.config.replica, membership, workers,
                 old, self.step)
        self.after_resize(self.step, workers, membership)
        self.cond.notify_all()

    def _read_size(self) -> int | None:
        """ps-0: the job's size from its job file, every SIZE_POLL_SECONDS (None between, or unreadable).
        Outside the lock: a file read."""
        source = self.config.size_source
        if source is None or self.clock() - self.size_checked < SIZE_POLL_SECONDS:
            return None
        self.size_checked = self.clock()
        return source()

    def _note_size(self, size: int | None) -> None:
        """ps-0: a size read from the job file; one that differs is the resize to make at the next cut."""
        if size is None or size == (self.target_size or self.config.workers):
            return
        self.target_size = None if size == self.config.workers else size
        if self.target_size is not None:
            log.info("%s: the job's size is now %d workers (was %d): resizing at the next cut",
                     self.config.replica, size, self.config.workers)

    def _cut_due(self) -> bool:
        """A resize is asked for and can still be made: no worker finished its share yet (after that the
        job is ending; the size it ends with stays, a joiner is released)."""
        return (self.target_size is not None and self.coordinator is not None and not self.done
                and not any(s.finished or s.done_pushing for s in self.workers.values()))

    def maybe_cut(self) -> bool:
        """ps-0: make the resize once no worker holds a batch it has not pushed: each live one waits in a
        pull here (all its pushes answered), and in Sync the step is complete. True when it was made."""
        if not self._cut_due():
            return False
        if self.config.aggregation == "Sync" and self.pending:
            return False
        assert self.coordinator is not None and self.target_size is not None
        live = set(self.coordinator.live())
        for w, state in self.workers.items():
            if state.last_contact is not None and w in live and not self.waiting.get(w):
                return False  # still computing a step whose batch its cursor does not show yet
        size, self.target_size = self.target_size, None
        membership = self.coordinator.resize(size)
        self._set_size(size, membership)
        # Durable before any worker hears of it: a ps-0 restarted from an older checkpoint numbers
        # its own new set past this one (coordinator.load_state_dict).
        self.checkpoint(wait=True)
        if self.metrics:
            self.metrics.ps_resizes_total.inc()
        return True

    def _reject(self, reason: str) -> None:
        """Count a push not applied: `duplicate`, `non_finite` or `invalid` (metrics.REJECT_REASONS)."""
        if self.metrics:
            self.metrics.ps_rejected_pushes_total.labels(reason=reason).inc()

    def _accept(self, header: pb.PushHeader, grads: dict[str, torch.Tensor] | None) -> pb.PushReply:
        """Take a push that arrived whole and finite (grads None: a push without a gradient)."""
        # Again under the lock: a new set may have come while the push was received.
        self._check_membership(header.membership, header.world_size)
        self._check_worker(header.worker)
        worker = self._touch(header.worker)
        worker.incarnation = header.incarnation
        if self.done:
            return pb.PushReply(outcome=pb.PushReply.DONE, step=self.step)
        # Before the refusals below: a worker whose last push met a restarted
        # shard has still reached that step, and Finish is checked against it.
        worker.progress = max(worker.progress, header.worker_step)
        if header.ps_incarnation and header.ps_incarnation != self.incarnation:
            raise WireError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.config.replica} restarted since those parameters were pulled (incarnation "
                f"{header.ps_incarnation}, now {self.incarnation}, at step {self.step}); pull again",
            )
        if header.base_step > self.step:
            raise WireError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"push for step {header.base_step} is from the future: {self.config.replica} is at step {self.step}",
            )
        # At most once per (worker, worker_step), whatever the incarnation: a
        # retry, or a replay by a restarted (or impersonated) worker, of a step
        # already taken is acknowledged and not applied.
        if header.worker_step in worker.taken:
            self._reject("duplicate")
            return pb.PushReply(outcome=pb.PushReply.DUPLICATE, step=self.step)
        if self.config.aggregation == "Sync" and header.base_step >= self.step and header.worker in self.pending:
            # One push per worker and Sync step: another worker_step for a step it is already counted in.
            self._reject("duplicate")
            return pb.PushReply(outcome=pb.PushReply.DUPLICATE, step=self.step)
        worker.taken.add(header.worker_step)
        worker.worker_step = header.worker_step
        worker.done_pushing = False
        if self.coordinator is not None:
            self.coordinator.record(header.worker, header.worker_step, header.cursor_json)
        taken = pb.PushReply.SKIPPED if grads is None else pb.PushReply.APPLIED
        if self.config.aggregation == "Sync":
            if header.base_step < self.step:
                return pb.PushReply(outcome=pb.PushReply.STALE, step=self.step)
            if grads is not None:
                for name, grad in grads.items():
                    self.pending_sum[name].add_(grad)
                self.contributors += 1
            self.pending.add(header.worker)
            if self.first_push_at is None:
                self.first_push_at = self.clock()
            self.maybe_complete_sync_step()
            return pb.PushReply(outcome=taken, step=self.step)
        if grads is None:
            return pb.PushReply(outcome=taken, step=self.step)
        staleness = self.step - header.base_step
        if self.metrics:
            self.metrics.staleness_steps.observe(staleness)
        self._apply(grads)
        return pb.PushReply(outcome=taken, step=self.step, staleness=staleness)

    def _held(self, request: pb.PullRequest) -> bool:
        """Whether a pull must wait before it gets parameters."""
        if self.done:
            return False
        if request.final:
            return any(not s.finished for w, s in self.workers.items() if w != request.worker)
        if self._cut_due():
            # A resize waits for every worker to come here (maybe_cut); in Sync, not one whose push the
            # step in progress still waits for: it gets this step's parameters, and the cut the boundary.
            sync = self.config.aggregation == "Sync"
            if not (sync and self.pending and request.worker not in self.pending):
                return True
        if self.config.aggregation == "Sync":
            same_incarnation = request.ps_incarnation in (0, self.incarnation)
            return same_incarnation and request.min_step > self.step
        # A worker a resize added is waited for once it called: Async takes the new set at once.
        others = [
            s.worker_step for w, s in self.workers.items()
            if w != request.worker and not s.finished and self._alive(s)
            and not (s.since is not None and s.last_contact is None)
        ]
        return bool(others) and request.worker_step > min(others) + self.config.max_staleness

    # --- RPC handlers ----------------------------------------------------------------------

    def _check_worker(self, worker: int) -> None:
        if worker >= self.config.workers:
            raise WireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} is outside this job's {self.config.workers} workers (0..{self.config.workers - 1})",
            )

    @contextmanager
    def _watched(self, kind: str, worker: int, context: grpc.ServicerContext,
                 stall_seconds: float | None) -> Iterator[StreamWatch]:
        """Register a stream with the watchdog (tick) for as long as its handler runs."""
        now = self.clock()
        watch = StreamWatch(kind, worker, context, now, now, stall_seconds)
        with self.streams_lock:
            self.streams.add(watch)
        try:
            yield watch
        finally:
            with self.streams_lock:
                self.streams.discard(watch)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[WireFrame]:
        try:
            with self.cond:
                self._check_membership(request.membership, request.world_size)
            self._check_worker(request.worker)
        except WireError as err:
            if err.reason:
                context.set_trailing_metadata(((REFUSAL_KEY, err.reason),))
            context.abort(err.code, str(err))
        with self._watched("Pull", request.worker, context, stall_seconds=None):
            with self.cond:
                worker = self._touch(request.worker)
                worker.worker_step = max(worker.worker_step, request.worker_step)
                if request.final:
                    worker.done_pushing = True
                    self.maybe_complete_sync_step()
                entered = self.membership
                self.waiting[request.worker] = self.waiting.get(request.worker, 0) + 1
                try:
                    # A new set of workers (a resize, here or taken from another worker's call) ends the
                    # wait: the caller registers again, and its next pull is held as the new set's.
                    while self.membership == entered and self._held(request) and context.is_active():
                        self.cond.wait(TICK_SECONDS)
                        self._touch(request.worker)
                finally:
                    self.waiting[request.worker] -= 1
                if not context.is_active():
                    return  # cancelled while held: by its client, or by tick()
                step, tensors = self.published
                header = pb.PullHeader(step=step, ps_incarnation=self.incarnation, done=self.done,
                                       membership=self.membership)
                left = request.worker not in self.workers  # released by a resize while it waited
            out = (self._whole_tensors(tensors) if left else self._pull_tensors(request, tensors, header))
            yield from frames_for(out, self.config.chunk_bytes, pb.Frame(pull=header))

    @staticmethod
    def _whole_tensors(tensors: dict[str, torch.Tensor]) -> list[OutTensor]:
        return [OutTensor(n, dtype_name(t.dtype), tuple(t.shape), "None", as_bytes(t)) for n, t in tensors.items()]

    def _pull_tensors(self, request: pb.PullRequest, tensors: dict[str, torch.Tensor],
                      header: pb.PullHeader) -> list[OutTensor]:
        """The tensors of a pull reply: whole, or (lossy compression) the changes since the worker's copy.

        Encoded, and the worker's copy replaced, before the first frame goes
        out: a worker that received any of this reply and retries names its
        old copy, which no longer matches, and gets a whole pull.
        """
        if not self.pulls.enabled:
            return self._whole_tensors(tensors)
        with self.workers[request.worker].pull_lock:
            encoded = self.pulls.encode(request.worker, request.copy, tensors, request.worker_step, request.final)
        header.copy, header.copy_crc32 = encoded.copy, encoded.crc32
        return [OutTensor(n, dtype_name(t.dtype), tuple(t.shape), encoded.tensors[n].codec, encoded.tensors[n].payload)
                for n, t in tensors.items()]

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        # A cancelled stream (by its client, or by tick() as stalled) raises the
        # request iterator's grpc.RpcError out of here: gRPC knows it as its own
        # and ends the call quietly. Nothing was taken.
        return self.push_frames((decode_frame(message) for message in request_iterator), context)

    def push_frames(self, frames: Iterator[WireFrame], context: Any) -> pb.PushReply:
        """A push's frames, from gRPC (Push) or the data plane (dataplane.py, with its own context)."""
        try:
            return self._push(frames, context)
        except WireError as err:
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                self._reject(err.reason or "invalid")
            if err.reason:
                context.set_trailing_metadata(((REFUSAL_KEY, err.reason),))
            context.abort(err.code, str(err))
            raise  # unreachable: abort raises (grpc's context and the data plane's alike)

    def _push(self, frames: Iterator[WireFrame], context: Any) -> pb.PushReply:
        # Watched from the start: a client may stall before its first frame too.
        with self._watched("Push", -1, context, self.config.push_stall_seconds) as watch:
            frame = next(frames, None)
            if frame is None:
                raise invalid("empty push: the first frame must carry a PushHeader")
            self.counter.add(received=frame.size)
            if not frame.header.HasField("push"):
                raise invalid("the first frame of a push must carry a PushHeader")
            header = frame.header.push
            with self.cond:
                self._check_membership(header.membership, header.world_size)
            self._check_worker(header.worker)
            watch.worker = header.worker
            watch.last_message = self.clock()
            worker = self.workers[header.worker]
            if header.no_gradient:
                if frame.header.pieces or next(frames, None) is not None:
                    raise invalid(f"worker {header.worker}: a push without a gradient (no_gradient) carries no tensors")
                with self.cond:
                    return self._accept(header, None)
            # One push per worker at a time uses its scratch buffers, reused from
            # push to push. Another one at the same time (a retry racing a stalled
            # attempt, or an impersonator) gets buffers of its own instead of
            # waiting: no stream holds up another.
            owned = worker.receive_lock.acquire(blocking=False)
            try:
                assembler = Assembler(self.expected, worker.scratch if owned else {})
                assembler.add(frame)
                for frame in frames:
                    watch.last_message = self.clock()
                    self.counter.add(received=frame.size)
                    assembler.add(frame)
                grads = assembler.finish()
                self._check_finite(header, grads)
                with self.cond:
                    reply = self._accept(header, grads)
                    self.raw_gradient_bytes += sum(e.nbytes for e in self.expected.values())
                    self.compressed_gradient_bytes += assembler.payload_bytes
                return reply
            finally:
                if owned:
                    worker.receive_lock.release()

    def _check_finite(self, header: pb.PushHeader, grads: dict[str, torch.Tensor]) -> None:
        """Refuse a gradient with a NaN or an Inf: applied, it would make every parameter it touches NaN for good.

        Checked on the decoded tensors, so a compressed payload is judged by
        what it decodes to (an Int8 scale of NaN, a PowerSGD product that overflows).
        """
        name = first_non_finite(grads)
        if name is None:
            return
        log.warning("%s: refused worker %d's push of its step %d: tensor %r is not finite",
                    self.config.replica, header.worker, header.worker_step, name)
        raise invalid(
            f"tensor {name!r} of worker {header.worker}'s push for its step {header.worker_step} holds NaN or Inf: "
            "refused, nothing applied (a worker skips a step whose gradients are not finite)",
            reason=NON_FINITE,
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self.cond:
            now = self.clock()
            return pb.StatusReply(
                replica=self.config.replica,
                step=self.step,
                ps_incarnation=self.incarnation,
                aggregation=self.config.aggregation,
                tensors=list(self.params),
                workers=[
                    pb.WorkerStatus(worker=w, worker_step=s.worker_step, finished=s.finished,
                                    seconds_since_contact=now - s.last_contact if s.last_contact is not None else -1)
                    for w, s in self.workers.items()
                ],
                dropped_total=self.dropped_total,
                # The durable one, not the one being written: a checkpoint is named only once it can be resumed.
                last_checkpoint_step=self.store.durable_step or 0,
            )

    def _finish_refusal(self, worker: int, incarnation: int) -> str | None:
        """Why `worker` may not finish yet (None: it may), from this shard's own record of its pushes.

        A Finish ends a worker's part of the job for good: the shard stops
        waiting for it, and once every worker finished, the job ends. So it
        is taken only when the shard's view agrees: training is over
        (maxSteps reached), or the worker pushed its last planned step.
        Every shard receives every push, so each one's view is the
        coordinator's (ps-0); checkpoints keep it across restarts. And only
        from the process that made the worker's latest push: finishing a
        worker that pushed its last step but has more to do (the chief still
        pulls the final parameters and evaluates) would end the job under it.
        """
        state = self.workers[worker]
        if not incarnation or incarnation != state.incarnation:
            # The worker's incarnation is not named: a caller that knows it could learn nothing new.
            return (f"worker {worker} cannot finish: the Finish does not come from the process that made its "
                    f"latest push to {self.config.replica}; a worker finishes after its last step")
        if self.done:
            return None
        plan, progress = self.config.worker_steps, state.progress
        if plan is not None and progress >= plan:
            return None
        planned = f"of {plan} planned" if plan is not None else f"and training runs to step {self.config.max_steps}"
        return (
            f"worker {worker} cannot finish: {self.config.replica} has its pushes up to its step {progress} on "
            f"record, {planned} (shard step {self.step}); a worker finishes after its last step"
        )

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        try:
            self._check_worker(request.worker)
        except WireError as err:
            context.abort(err.code, str(err))
        with self.cond:
            worker = self.workers[request.worker]
            # Asked again of a finished worker too: its answer (job_finished) is the worker's to hear.
            refusal = self._finish_refusal(request.worker, request.incarnation)
            if refusal is not None:
                log.warning("%s: refused Finish: %s", self.config.replica, refusal)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
            if not worker.finished:
                self._touch(request.worker)
                worker.finished = True
                if self.coordinator is not None:
                    self.coordinator.record(request.worker, worker.worker_step, request.cursor_json, finished=True)
                self.maybe_complete_sync_step()
                # Durable before the reply: the worker exits next, and a shard that
                # restarted without this would wait for it forever.
                self.checkpoint(wait=True)
            finished = all(s.finished for s in self.workers.values())
            if finished:
                self.job_finished.set()
                self.cond.notify_all()
            return pb.FinishReply(job_finished=finished)

    def tick(self) -> None:
        """Periodic work (serve.py calls it every TICK_SECONDS): the Sync timeout, and stalled streams.

        Pushes alone cannot notice silence; and a stream's handler, blocked
        waiting for its client, cannot notice it is stalled.
        """
        size = self._read_size()
        with self.cond:
            self.maybe_complete_sync_step()
            self._note_size(size)
            self.maybe_cut()
        self.cancel_stalled_streams()

    def cancel_stalled_streams(self) -> list[StreamWatch]:
        """Cancel streams silent past their stall limit or older than stream_seconds; returns them."""
        now = self.clock()
        limit = self.config.stream_seconds
        with self.streams_lock:
            overdue = [
                w for w in self.streams
                if not w.cancelled and (
                    (w.stall_seconds is not None and now - w.last_message > w.stall_seconds)
                    or (limit is not None and now - w.started > limit)
                )
            ]
            for watch in overdue:
                watch.cancelled = True
        for watch in overdue:
            silent, age = now - watch.last_message, now - watch.started
            log.warning("%s: cancelled a %s stream of worker %d: silent %.1f s, open %.1f s (a stalled client)",
                        self.config.replica, watch.kind, watch.worker, silent, age)
            if self.metrics:
                self.metrics.ps_cancelled_streams_total.inc()
            watch.context.cancel()
        return overdue


def encode_counted(counter: ByteCounter) -> Callable[[WireFrame], bytes]:
    def serialize(frame: WireFrame) -> bytes:
        message = encode_frame(frame)
        counter.add(sent=len(message))
        return message

    return serialize


def build_server(shard: ParameterShard, token: str, max_workers: int) -> grpc.Server:
    """A gRPC server for the shard (and its coordinator, if any), behind the token check."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc"),
        interceptors=[TokenInterceptor(token)],
        options=GRPC_OPTIONS,
    )
    handlers = {
        "Pull": grpc.unary_stream_rpc_method_handler(
            shard.Pull, request_deserializer=pb.PullRequest.FromString, response_serializer=encode_counted(shard.counter)
        ),
        # Raw bytes in: the handler decodes frames itself, so bad ones get INVALID_ARGUMENT, not INTERNAL.
        "Push": grpc.stream_unary_rpc_method_handler(
            shard.Push, request_deserializer=None, response_serializer=pb.PushReply.SerializeToString
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            shard.Status, request_deserializer=pb.StatusRequest.FromString, response_serializer=pb.StatusReply.SerializeToString
        ),
        "Finish": grpc.unary_unary_rpc_method_handler(
            shard.Finish, request_deserializer=pb.FinishRequest.FromString, response_serializer=pb.FinishReply.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    if shard.coordinator is not None:
        ps_pb2_grpc.add_CoordinatorServicer_to_server(shard.coordinator, server)
    return server
