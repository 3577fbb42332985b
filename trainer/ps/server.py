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

Bad input on the wire (a wrong token, unknown tensors, wrong dtypes or
shapes, truncated or oversized chunks, steps from the future) is refused with
a gRPC status before anything changes: a push is received and checked whole
before it touches the parameters.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from ..checkpoint import CheckpointStore
from ..compression import as_bytes
from ..metrics import TrainerMetrics
from . import ps_pb2 as pb
from . import ps_pb2_grpc
from .coordinator import Coordinator
from .transport import (
    GRPC_OPTIONS,
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
    frames_for,
)

log = logging.getLogger(__name__)

SERVICE = "kubetrain.ps.v1.ParameterShard"
# How often waiting calls and the Sync timer look at the clock again.
TICK_SECONDS = 0.05
# A worker not heard from since this shard started is still importing torch,
# not silent, for this long: Sync waits for it (syncTimeoutSeconds per step at
# most), Async holds the others for it. One that never comes is dropped after.
STARTUP_GRACE_SECONDS = 60.0


@dataclass
class WorkerState:
    last_contact: float | None = None
    """None until the worker first calls: a worker still starting up is not silent."""
    worker_step: int = 0
    finished: bool = False
    done_pushing: bool = False
    incarnation: int = 0
    pushed_step: int = 0
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    receive_lock: threading.Lock = field(default_factory=threading.Lock)


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


class ParameterShard:
    """The state of one shard and the handlers of its RPCs (the ParameterShard service)."""

    def __init__(
        self,
        config: ShardConfig,
        params: dict[str, torch.Tensor],
        optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        store: CheckpointStore,
        coordinator: Coordinator | None = None,
        metrics: TrainerMetrics | None = None,
        after_step: Callable[[int], None] = lambda step: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.params = {n: torch.nn.Parameter(t.detach().clone(), requires_grad=True) for n, t in params.items()}
        self.expected = {n: Expected.of(p) for n, p in self.params.items()}
        self.optimizer = optimizer_factory(list(self.params.values()))
        self.store = store
        self.coordinator = coordinator
        self.metrics = metrics
        self.after_step = after_step
        self.clock = clock
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
        self.pending: set[int] = set()
        self.pending_sum = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.first_push_at: float | None = None
        self.job_finished = threading.Event()
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
            "workers": {w: {"finished": s.finished, "worker_step": s.worker_step} for w, s in self.workers.items()},
            "coordinator": self.coordinator.state_dict() if self.coordinator else {},
            "dropped_total": self.dropped_total,
        }

    def restore(self) -> bool:
        """Resume from the newest valid checkpoint; True when there was one."""
        found = self.store.load_latest()
        if found is None:
            return False
        step, state = found
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        for w, saved in state["workers"].items():
            self.workers[int(w)].finished = saved["finished"]
            self.workers[int(w)].worker_step = saved["worker_step"]
        if self.coordinator is not None:
            self.coordinator.load_state_dict(state["coordinator"])
        self.step = step
        self.dropped_total = state["dropped_total"]
        self.checkpoint_step = step
        self._publish()
        return True

    def checkpoint(self, wait: bool = False) -> None:
        """Save under the lock (the caller holds it): parameters, optimizer and cursors of one step."""
        self.store.save(self.step, self.state())
        self.checkpoint_step = self.step
        if wait:
            self.store.wait()

    @property
    def done(self) -> bool:
        max_steps = self.config.max_steps
        return (max_steps is not None and self.step >= max_steps) or self.job_finished.is_set()

    # --- aggregation (all under self.cond) ------------------------------------------------

    def _touch(self, worker: int) -> WorkerState:
        state = self.workers[worker]
        state.last_contact = self.clock()
        return state

    def _alive(self, state: WorkerState) -> bool:
        """Heard from within syncTimeoutSeconds; one not heard from yet is starting up, for a while."""
        now = self.clock()
        if state.last_contact is None:
            return now - self.started < max(self.config.sync_timeout, STARTUP_GRACE_SECONDS)
        return now - state.last_contact < self.config.sync_timeout

    def _expected_workers(self) -> set[int]:
        """Workers a Sync step waits for: alive, and neither finished nor done pushing."""
        return {w for w, s in self.workers.items() if not s.finished and not s.done_pushing and self._alive(s)}

    def _apply(self, grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        for name, param in self.params.items():
            param.grad = grads[name] if scale == 1.0 else grads[name] * scale
        self.optimizer.step()
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
        if missing and self.clock() - self.first_push_at < self.config.sync_timeout:
            return
        if missing:
            self.dropped_total += len(missing)
            if self.metrics:
                self.metrics.sync_dropped_workers_total.inc(len(missing))
            log.warning("%s: step %d: dropped silent workers %s", self.config.replica, self.step, sorted(missing))
        contributors = len(self.pending)
        self._apply(self.pending_sum, 1.0 / contributors)
        self.pending.clear()
        for buffer in self.pending_sum.values():
            buffer.zero_()
        self.first_push_at = None

    def _accept(self, header: pb.PushHeader, grads: dict[str, torch.Tensor]) -> pb.PushReply:
        worker = self._touch(header.worker)
        if self.done:
            return pb.PushReply(outcome=pb.PushReply.DONE, step=self.step)
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
        if header.incarnation == worker.incarnation and header.worker_step <= worker.pushed_step:
            return pb.PushReply(outcome=pb.PushReply.DUPLICATE, step=self.step)
        worker.incarnation, worker.pushed_step = header.incarnation, header.worker_step
        worker.worker_step = header.worker_step
        worker.done_pushing = False
        if self.coordinator is not None:
            self.coordinator.record(header.worker, header.worker_step, header.cursor_json)
        if self.config.aggregation == "Sync":
            if header.base_step < self.step:
                return pb.PushReply(outcome=pb.PushReply.STALE, step=self.step)
            if header.worker in self.pending:
                return pb.PushReply(outcome=pb.PushReply.DUPLICATE, step=self.step)
            for name, grad in grads.items():
                self.pending_sum[name].add_(grad)
            self.pending.add(header.worker)
            if self.first_push_at is None:
                self.first_push_at = self.clock()
            self.maybe_complete_sync_step()
            return pb.PushReply(outcome=pb.PushReply.APPLIED, step=self.step)
        staleness = self.step - header.base_step
        if self.metrics:
            self.metrics.staleness_steps.observe(staleness)
        self._apply(grads)
        return pb.PushReply(outcome=pb.PushReply.APPLIED, step=self.step, staleness=staleness)

    def _held(self, request: pb.PullRequest) -> bool:
        """Whether a pull must wait before it gets parameters."""
        if self.done:
            return False
        if request.final:
            return any(not s.finished for w, s in self.workers.items() if w != request.worker)
        if self.config.aggregation == "Sync":
            same_incarnation = request.ps_incarnation in (0, self.incarnation)
            return same_incarnation and request.min_step > self.step
        others = [
            s.worker_step for w, s in self.workers.items() if w != request.worker and not s.finished and self._alive(s)
        ]
        return bool(others) and request.worker_step > min(others) + self.config.max_staleness

    # --- RPC handlers ----------------------------------------------------------------------

    def _check_worker(self, worker: int) -> None:
        if worker >= self.config.workers:
            raise WireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} is outside this job's {self.config.workers} workers (0..{self.config.workers - 1})",
            )

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[WireFrame]:
        try:
            self._check_worker(request.worker)
        except WireError as err:
            context.abort(err.code, str(err))
        with self.cond:
            worker = self._touch(request.worker)
            worker.worker_step = max(worker.worker_step, request.worker_step)
            if request.final:
                worker.done_pushing = True
                self.maybe_complete_sync_step()
            while self._held(request) and context.is_active():
                self.cond.wait(TICK_SECONDS)
                self._touch(request.worker)
            step, tensors = self.published
            header = pb.PullHeader(step=step, ps_incarnation=self.incarnation, done=self.done)
        out = [OutTensor(n, dtype_name(t.dtype), tuple(t.shape), "None", as_bytes(t)) for n, t in tensors.items()]
        yield from frames_for(out, self.config.chunk_bytes, pb.Frame(pull=header))

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        try:
            return self._push(request_iterator)
        except WireError as err:
            context.abort(err.code, str(err))

    def _push(self, messages: Iterator[bytes]) -> pb.PushReply:
        first = next(messages, None)
        if first is None:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "empty push: the first frame must carry a PushHeader")
        self.counter.add(received=len(first))
        frame = decode_frame(first)
        if not frame.header.HasField("push"):
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "the first frame of a push must carry a PushHeader")
        header = frame.header.push
        self._check_worker(header.worker)
        worker = self.workers[header.worker]
        # One push per worker at a time: its scratch buffers are reused from push to push.
        with worker.receive_lock:
            assembler = Assembler(self.expected, worker.scratch)
            assembler.add(frame)
            for message in messages:
                self.counter.add(received=len(message))
                assembler.add(decode_frame(message))
            grads = assembler.finish()
            with self.cond:
                reply = self._accept(header, grads)
                self.raw_gradient_bytes += sum(e.nbytes for e in self.expected.values())
                self.compressed_gradient_bytes += assembler.payload_bytes
        return reply

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
                last_checkpoint_step=max(self.checkpoint_step, 0),
            )

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.FinishReply:
        try:
            self._check_worker(request.worker)
        except WireError as err:
            context.abort(err.code, str(err))
        with self.cond:
            worker = self._touch(request.worker)
            if not worker.finished:
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
        """Re-check the Sync timeout (called periodically; pushes alone cannot notice silence)."""
        with self.cond:
            self.maybe_complete_sync_step()


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
