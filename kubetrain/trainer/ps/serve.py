"""The `ps` role: one parameter-server shard process, from start (or resume) to the job's end."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from kubetrain.api.load import documents, from_object
from kubetrain.api.schema import InvalidSpec, Problem
from kubetrain.api.spec import MAX_STANDBY_WORKERS

from ..context import ReplicaContext
from ..session import JobCheckpoints
from ..data import ShardCursor
from ..device import make_deterministic
from ..errors import EXIT_OK, EXIT_TERMINATED, ConfigError, TransientError
from ..events import EventLog, startup, write_result
from ..metrics import TrainerMetrics
from ..preload import preload, without_dynamo_import
from ..training import log_interval
from .coordinator import MAX_WORKERS, Coordinator
from .dataplane import DataServer, ensure_descriptors, max_connections
from .job import chunk_bytes, model_and_data, ps_spec, shard_optimizer, shards_of
from .server import TICK_SECONDS, ParameterShard, ShardConfig, build_server
from .credentials import from_env as tls_from_env
from .transport import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)


def planned_global_steps(ctx: ReplicaContext, steps_per_epoch: int) -> int:
    """Updates the job makes: maxSteps, or each worker's epochs of steps (all of them, in Async)."""
    training, ps = ctx.spec.require_training(), ps_spec(ctx)
    if training.max_steps is not None:
        return training.max_steps
    local = (training.effective_epochs or 0) * steps_per_epoch
    return local if ps.aggregation == "Sync" else local * ps.workers


def planned_worker_steps(ctx: ReplicaContext, steps_per_epoch: int) -> int | None:
    """Steps each worker runs: its epochs of its data shard; None with maxSteps (the shards' step ends training).

    The worker stops there, and a shard takes its Finish only once it pushed that far.
    """
    training = ctx.spec.require_training()
    if training.max_steps is not None or not training.effective_epochs:
        return None
    return training.effective_epochs * steps_per_epoch


def size_source(ctx: ReplicaContext):
    """The job's size as its job file says now (ps-0 polls it: an elastic job resizes live); None when the
    file does not load or says another job, logged once per content."""
    path = ctx.job_file
    seen: dict[str, int | None] = {}

    def read() -> int | None:
        if path is None:
            return None
        try:
            text = path.read_text()
        except OSError as err:
            text = f"unreadable: {err}"
        if text not in seen:
            seen.clear()
            seen[text] = _size_of(ctx, path, text)
        return seen[text]

    return read


def _size_of(ctx: ReplicaContext, path, text: str) -> int | None:
    if text.startswith("unreadable: "):
        log.warning("%s: %s: %s; the job keeps its size", ctx.replica, path, text)
        return None
    try:
        docs = documents(text, str(path))
        if len(docs) != 1:
            raise InvalidSpec([Problem("(file)", f"must hold exactly one TrainingJob, found {len(docs)}")], str(path))
        job = from_object(docs[0], str(path))
    except InvalidSpec as err:
        log.warning("%s: %s no longer loads (%s); the job keeps its size", ctx.replica, path, err)
        return None
    if job.name != ctx.job.name or job.spec.mode != ctx.spec.mode:
        log.warning("%s: %s now names another job; the job keeps its size", ctx.replica, path)
        return None
    return job.spec.size


def steps_at(ctx: ReplicaContext, num_samples: int):
    """planned_worker_steps at a number of workers: a shard's Finish check follows a resize."""
    batch = ctx.spec.require_training().batch_size
    return lambda workers: planned_worker_steps(ctx, ShardCursor(num_samples, 0, workers, batch, 0).steps_per_epoch)


def run_ps(ctx: ReplicaContext) -> int:
    """Serve shard `ctx.index` until every worker has finished (0) or SIGTERM (143)."""
    process = ShardProcess(ctx)
    try:
        process.restore()
        process.listen()
        return process.serve()
    finally:
        process.close()


class ShardProcess:
    """One `ps` process in its phases: build the shard, restore it, listen, serve until the end, close."""

    def __init__(self, ctx: ReplicaContext):
        self.started = time.monotonic()
        self.ctx = ctx
        self.ps = ps = ps_spec(ctx)
        if ctx.index >= ps.replicas:
            raise ConfigError(
                f"KUBETRAIN_REPLICA: {ctx.replica} is outside spec.parameterServer.replicas ({ps.replicas})")
        if not ctx.ps_port:
            raise ConfigError("KUBETRAIN_PS_PORT: not set; a parameter server needs a port to listen on")
        make_deterministic()
        without_dynamo_import()  # the optimizer's constructor and restore, without torch._dynamo (preload.py)
        model, data = model_and_data(ctx)
        startup("model")
        names = shards_of(model, ps.replicas)[ctx.index]
        self.params = {n: p for n, p in model.named_parameters() if n in names}
        self.num_samples = len(data.train_x)
        self.steps_per_epoch = ShardCursor(self.num_samples, 0, ps.workers, ctx.spec.require_training().batch_size,
                                           0).steps_per_epoch
        self.total_steps = planned_global_steps(ctx, self.steps_per_epoch)
        self.interval = log_interval(self.total_steps)
        self.metrics = TrainerMetrics(ctx)
        self.events = EventLog(ctx.run_dir, ctx.replica)
        self.first_step_logged = False
        self.resumed = False
        self.server: grpc.Server | None = None
        self.data: DataServer | None = None
        self.tls: Any = None  # the job's certificates (credentials.py), None: plaintext
        # The job's checkpoints, as every replica's: the shard saves under its lock
        # and restores its parameters in place.
        self.store = JobCheckpoints(ctx, self.metrics, self.events)
        self.shard = self._build_shard()

    def _build_shard(self) -> ParameterShard:
        ctx, ps, training = self.ctx, self.ps, self.ctx.spec.require_training()
        first = ctx.index == 0  # ps-0 hosts the coordinator and follows the job file's size
        config = ShardConfig(
            replica=ctx.replica, workers=ps.workers, compression=ps.compression,
            aggregation=ps.aggregation, sync_timeout=ps.sync_timeout_seconds, max_staleness=ps.max_staleness,
            max_steps=training.max_steps, interval_steps=ctx.spec.checkpoint.interval_steps,
            chunk_bytes=chunk_bytes(),
            worker_steps=planned_worker_steps(ctx, self.steps_per_epoch),
            worker_steps_for=steps_at(ctx, self.num_samples),
            size_source=size_source(ctx) if first else None,
        )
        coordinator = Coordinator(ps.workers, ps.sync_timeout_seconds, metrics=self.metrics) if first else None
        return ParameterShard(
            config, self.params, lambda p: shard_optimizer(p, training.optimizer, ps.compression), self.store,
            coordinator=coordinator, metrics=self.metrics, after_step=self._after_step,
            after_resize=lambda step, workers, membership: self.events.write(
                "resize", step=step, workers=workers, membership=membership),
        )

    def _after_step(self, step: int) -> None:
        startup("first_step", step=step)  # the first update since this process started (a restart's first)
        self.ctx.maybe_fault(step)
        if step % self.interval == 0 or not self.first_step_logged or step == self.total_steps:
            self.events.write("step", step=step, dropped_total=self.shard.dropped_total)
            self.first_step_logged = True

    def restore(self) -> None:
        """Resume from the newest checkpoint, if any; torch._dynamo imported; /metrics served."""
        shard, metrics = self.shard, self.metrics
        self.resumed = shard.restore()
        startup("restored", step=shard.step, resumed=self.resumed)
        # torch._dynamo, which torch's optimizer step imports (preload.py). A shard restarted mid-job has
        # workers waiting for it: it listens first and imports it while they reconnect, its updates
        # meanwhile made without it (preload.optimizer_step). A new job's workers are starting too (their
        # own imports take as long), so its shard imports it before it listens, and its first updates do
        # not compete with the import for the interpreter.
        preloading = preload()
        if not self.resumed:
            preloading.join()
        metrics.process_starts_total.inc()
        metrics.total_steps.set(self.total_steps)
        metrics.ps_workers.set(shard.config.workers)
        metrics.training_step.set(shard.step)
        metrics.serve(self.ctx.metrics_port, self.ctx.listen_address)

    def listen(self) -> None:
        """Serve gRPC (and the data plane, if the job has one) on the shard's ports."""
        ctx, shard = self.ctx, self.shard
        # Every Pull that waits holds a thread: two per worker, and some to spare for Status and Finish; with
        # standby workers ps-0 holds one more per worker and per standby (their Stand calls, coordinator.py).
        # Threads start as calls need them, so the bound is the most workers a resize can bring (MAX_WORKERS).
        self.server = server = build_server(shard, ctx.token, max_workers=3 * MAX_WORKERS + MAX_STANDBY_WORKERS + 8)
        self.tls = tls = tls_from_env()  # the job's certificates: mutual TLS with every worker (credentials.py)
        address = f"{ctx.listen_address}:{ctx.ps_port}"
        try:
            if tls is None:
                server.add_insecure_port(address)
            else:
                server.add_secure_port(address, tls.server_credentials())
        except RuntimeError as err:
            raise TransientError(f"KUBETRAIN_PS_PORT: cannot listen on port {ctx.ps_port}: {err}") from None
        if ctx.ps_data_port:  # Pull and Push of tensors beside gRPC (dataplane.py): a thread per connection
            self._listen_data()
        server.start()
        startup("serving")
        self.events.write("start", step=shard.step, total_steps=self.total_steps, tensors=len(self.params),
                          parameter_bytes=sum(e.nbytes for e in shard.expected.values()),
                          incarnation=shard.incarnation)
        if self.resumed:
            self.events.write("resume", step=shard.step)
        log.info("%s: serving %d tensors on port %d%s (%s) from step %d%s", ctx.replica, len(self.params),
                 ctx.ps_port, f", data plane on {ctx.ps_data_port}" if self.data else "",
                 "mutual TLS" if tls else "plaintext", shard.step, " (resumed)" if self.resumed else "")

    def _listen_data(self) -> None:
        ctx, shard = self.ctx, self.shard
        connections = max_connections(MAX_WORKERS, MAX_STANDBY_WORKERS)
        ensure_descriptors(connections)
        self.data = DataServer(shard, ctx.token, self.tls, max_connections=connections,
                               drain_bytes=sum(e.nbytes for e in shard.expected.values()) + MAX_MESSAGE_BYTES,
                               metrics=self.metrics)
        try:
            self.data.start(ctx.listen_address, ctx.ps_data_port)
        except OSError as err:
            raise TransientError(f"KUBETRAIN_PS_DATA_PORT: cannot listen on port {ctx.ps_data_port}: {err}") from None

    def serve(self) -> int:
        """Until every worker finished (the final checkpoint and the results: 0) or SIGTERM (143)."""
        shard = self.shard
        while not shard.job_finished.wait(TICK_SECONDS):
            shard.tick()
            if self.ctx.stop_requested:
                return self._stop()
        return self._finish()

    def _stop(self) -> int:
        # No call is taken after the final checkpoint: a push applied after it would be lost to the
        # restart, and the stop event would name an older step than the checkpoint. Calls in flight
        # are cancelled; workers retry CANCELLED against the restarted shard. A push already inside
        # its handler can still land after the checkpoint (not closed yet).
        self._stop_listening()
        with self.shard.cond:
            self.shard.checkpoint(wait=True)
            stopped_at = self.shard.step
        self.events.write("stop", step=stopped_at)
        log.info("%s: stopped by SIGTERM at step %d, checkpoint written", self.ctx.replica, stopped_at)
        return EXIT_TERMINATED

    def _finish(self) -> int:
        ctx, shard = self.ctx, self.shard
        with shard.cond:
            if shard.checkpoint_step != shard.step:
                shard.checkpoint(wait=True)
        self.store.wait()
        assert self.server is not None
        # Grace: the reply to the last Finish is still on its way out.
        self.server.stop(grace=2.0).wait()
        wall = time.monotonic() - self.started
        write_result(ctx.run_dir, ctx.replica, {
            "steps": shard.step,
            "bytes_sent": shard.counter.sent,
            "bytes_received": shard.counter.received,
            "raw_gradient_bytes": shard.raw_gradient_bytes,
            "compressed_gradient_bytes": shard.compressed_gradient_bytes,
            "whole_pulls": shard.pulls.whole_pulls,
            "compressed_pulls": shard.pulls.compressed_pulls,
            "sparse_pull_tensors": shard.pulls.sparse_pull_tensors,
            "sync_dropped_workers": shard.dropped_total,
            "wall_seconds": wall,
            "checkpoint_step": shard.checkpoint_step,
            "checkpoint_time": time.time(),  # durable by now: the store was waited for
        }, termination_log=ctx.termination_log)
        self.events.write("end", step=shard.step, wall_seconds=wall)
        log.info("%s: every worker finished; final checkpoint at step %d", ctx.replica, shard.step)
        return EXIT_OK

    def _stop_listening(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
        if self.data is not None:
            self.data.stop()

    def close(self) -> None:
        self._stop_listening()
        self.metrics.close()
        self.events.close()
