"""The `worker` role: pull parameters, compute a gradient on the next batch, push it; repeat.

A worker holds no state worth saving: parameters and optimizer live on the
shards, and its data cursor travels with every push to ps-0 (the
coordinator). A restarted worker registers, receives its cursor and goes on
with the next batch. worker-0 is the chief: when training ends it waits for
the final parameters of every shard and evaluates them.

A step whose gradients hold NaN or Inf (the loss exploded, a bad batch) is
skipped, as torch.amp's GradScaler skips one: the worker pushes no gradient
for it (the shards would refuse one), tells the shards the step is done so a
Sync step does not wait for it, counts it and goes on. Checked before
compression, so error feedback never carries a NaN into later steps.
MAX_CONSECUTIVE_NON_FINITE_STEPS in a row end the worker: training diverged.

An elastic job's resize is live (server.py, coordinator.py): a pull answered
with another membership than the worker's, or refused for it, makes the
worker register again. It then takes its new cursor (the rest of the epoch
dealt again among the new set) and goes on, or, released (its index is past
the new size), it exits EXIT_RELEASED (76) and leaves no result.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from ..compression import GradientCompressor, copy_crc32
from ..context import ReplicaContext
from ..device import make_deterministic, select_device
from ..errors import EXIT_OK, EXIT_RELEASED, EXIT_TERMINATED, ConfigError, TransientError
from ..events import EventLog, startup, write_result
from ..metrics import TrainerMetrics
from ..models import evaluate
from ..testhooks import Slowdown
from ..training import compute_gradients, log_interval
from . import ps_pb2 as pb
from .psclient import PSClient, wait_timeout
from .job import chunk_bytes, model_and_data, ps_spec, shards_of
from .serve import planned_global_steps, planned_worker_steps
from .standby import Place, as_worker
from .credentials import from_env as tls_from_env
from .transport import (
    MEMBERSHIP,
    NON_FINITE,
    Assembler,
    Backoff,
    Expected,
    OutTensor,
    dtype_name,
    first_non_finite,
    refusal_reason,
)

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
# Non-finite steps in a row after which a worker gives up. A loss spike gives
# isolated ones (an outlier batch; the next batch is fine), and the shards
# never applied a NaN, so their parameters are intact. Ten in a row, each on
# freshly pulled parameters and a new batch, means those parameters
# themselves give NaN: the run diverged (a learning rate too high, data with
# NaN), and a restart would replay the same steps. Exit 2, permanent.
MAX_CONSECUTIVE_NON_FINITE_STEPS = 10


class Released(Exception):
    """ps-0 released this worker: a resize left its index past the job's size."""


class Worker:
    """One worker process: its model replica, cursor, compressor and client."""

    def __init__(self, ctx: ReplicaContext, place: Place | None = None):
        self.started = time.monotonic()
        self.ctx = ctx
        self.place = place
        """Its place held at ps-0 (a job with standby workers, standby.py); None: no Stand call."""
        spec = ctx.spec
        self.ps = ps_spec(ctx)
        if ctx.index >= self.ps.workers:
            raise ConfigError(f"KUBETRAIN_REPLICA: {ctx.replica} is outside spec.parameterServer.workers ({self.ps.workers})")
        if len(ctx.ps_addrs) != self.ps.replicas:
            raise ConfigError(
                f"KUBETRAIN_PS_ADDRS: lists {len(ctx.ps_addrs)} shards, spec.parameterServer.replicas is {self.ps.replicas}"
            )
        if ctx.ps_data_addrs and len(ctx.ps_data_addrs) != self.ps.replicas:
            raise ConfigError(f"KUBETRAIN_PS_DATA_ADDRS: lists {len(ctx.ps_data_addrs)} shards, "
                              f"spec.parameterServer.replicas is {self.ps.replicas}")
        make_deterministic()
        self.device = select_device(spec.require_training().device)
        self.model, self.data = model_and_data(ctx)
        startup("model")
        self.model.to(self.device)
        self.params = dict(self.model.named_parameters())
        self.shards = shards_of(self.model, self.ps.replicas)
        # Pulled parameters land in place: in the model itself on a CPU, else in a CPU mirror.
        self.landing = (
            {n: p.data for n, p in self.params.items()} if self.device.type == "cpu"
            else {n: torch.empty_like(p, device="cpu") for n, p in self.params.items()}
        )
        self.scratch: list[dict] = [{} for _ in self.shards]
        self.train_x = self.data.train_x.to(self.device)
        self.train_y = self.data.train_y.to(self.device)
        self.world = self.ps.workers
        """The workers of the job's current set (ps-0's membership): the job file's size until registered."""
        self.membership = 0
        self.redealt = False
        self.cursor = self.data.cursor(ctx.index, self.world, spec.require_training().batch_size, spec.require_training().seed)
        self.total_steps = planned_global_steps(ctx, self.cursor.steps_per_epoch)
        self.local_total = planned_worker_steps(ctx, self.cursor.steps_per_epoch)
        self.epochs = None if spec.require_training().max_steps is not None else spec.require_training().effective_epochs
        self.compressor = GradientCompressor(self.ps.compression, spec.require_training().optimizer, self.params)
        self.metrics = TrainerMetrics(ctx)
        self.data.attach_metrics(self.metrics)
        self.events = EventLog(ctx.run_dir, ctx.replica)
        self.incarnation = random.getrandbits(63) or 1
        self.client = PSClient(
            ctx.ps_addrs, ctx.token, chunk_bytes(),
            # Told to stop (SIGTERM) while a shard is away, it stops retrying: its cursor is with ps-0 as
            # of its last push, and nothing of it is lost by exiting at once.
            Backoff(budget=float(spec.run_policy.progress_deadline_seconds), give_up=lambda: ctx.stop_requested),
            wait_timeout=wait_timeout(self.ps.sync_timeout_seconds), metrics=self.metrics,
            tls=tls_from_env(),  # the job's certificates: mutual TLS to every shard (credentials.py)
            data_addrs=ctx.ps_data_addrs,  # Pull and Push on the shards' data planes (dataplane.py)
        )
        self.pool = ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="shard")
        self.ps_step = [0] * len(self.shards)
        self.ps_incarnation = [0] * len(self.shards)
        self.min_step = [0] * len(self.shards)
        self.shard_done = [False] * len(self.shards)
        self.copy = [0] * len(self.shards)
        """Per shard, the copy of its parameters this worker holds (PullHeader.copy); 0: none, pull whole."""
        self.copy_mismatches = 0
        self.worker_step = 0
        self.non_finite_streak = 0
        self.slowdown = Slowdown.for_replica(ctx.replica)  # a benchmark's straggler (kubetrain/trainer/testhooks.py)
        self.samples = 0
        self.loss = float("nan")
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)

    # --- calls to every shard -------------------------------------------------------

    def _each_shard(self, fn) -> list[Any]:
        if len(self.shards) == 1:
            return [fn(0)]
        return list(self.pool.map(fn, range(len(self.shards))))

    def pull(self, final: bool = False) -> list[pb.PullHeader]:
        """The parameters of every shard; a new set of workers (a resize) first: register again, pull again."""
        headers = self._pull_once(final)
        while any(h is None for h in headers) or headers[0].membership not in (0, self.membership):  # type: ignore[union-attr]
            self._join(self.client.register(self.ctx.index, self.incarnation, self.membership, self.world))
            headers = self._pull_once(final)
        return [h for h in headers if h is not None]  # every one, by the loop's end

    def _pull_once(self, final: bool) -> list[pb.PullHeader | None]:
        def one(s: int) -> pb.PullHeader | None:
            names = self.shards[s]
            expected = {n: Expected.of(self.params[n]) for n in names}
            request = pb.PullRequest(
                worker=self.ctx.index, worker_step=self.worker_step, min_step=self.min_step[s],
                ps_incarnation=self.ps_incarnation[s], final=final, copy=self.copy[s],
                membership=self.membership, world_size=self.world,
            )
            # Lossy pieces are changes to this copy (compressed pulls), added in place.
            try:
                header, _ = self.client.pull(
                    s, request, lambda: Assembler(expected, self.scratch[s], {n: self.landing[n] for n in names},
                                                  changes=True))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and refusal_reason(err) == MEMBERSHIP:
                    return None  # the job's workers changed: register again (pull)
                raise
            self.ps_step[s], self.ps_incarnation[s] = header.step, header.ps_incarnation
            self.shard_done[s] = header.done
            self.copy[s] = self._check_copy(s, header)
            return header

        headers = self._each_shard(one)
        if self.device.type != "cpu":
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(self.landing[name])
        return headers

    def _check_copy(self, s: int, header: pb.PullHeader) -> int:
        """The copy to name in the next pull: the shard's, if this worker's parameters match it bit for bit.

        They do unless a decode differs between the two machines (PowerSGD's
        matrix product on other CPUs may round differently): then this worker
        names no copy and its next pull is whole, so the difference never grows.
        """
        if not header.copy:
            return 0
        mine = copy_crc32(self.landing[n] for n in sorted(self.shards[s]))
        if mine == header.copy_crc32:
            return header.copy
        self.copy_mismatches += 1
        log.warning("%s: its parameters differ from the copy shard %d sent (CRC-32 %08x, the shard's %08x); "
                    "its next pull is whole", self.ctx.replica, s, mine, header.copy_crc32)
        return 0

    def _header(self, s: int, cursor_json: str) -> pb.PushHeader:
        return pb.PushHeader(
            worker=self.ctx.index, incarnation=self.incarnation, worker_step=self.worker_step,
            base_step=self.ps_step[s], ps_incarnation=self.ps_incarnation[s],
            cursor_json=cursor_json if s == 0 else "", loss=self.loss,
            membership=self.membership, world_size=self.world,
        )

    def push(self, grads: dict[str, torch.Tensor] | None) -> list[pb.PushReply | None]:
        """Push this step's gradients to every shard not done yet (None: a step without a gradient).

        A shard that refuses the gradient as not finite (finite here, but not
        once a codec made it so: FP16 beyond 65504) gets the step without a
        gradient instead; the reply then says SKIPPED.
        """
        encoded = {} if grads is None else {
            n: self.compressor.compress(n, g, self.worker_step - 1) for n, g in grads.items()}
        cursor_json = json.dumps(self.cursor.state_dict())

        def one(s: int) -> pb.PushReply | None:
            if self.shard_done[s]:
                return None  # training is over there: nothing to push
            header = self._header(s, cursor_json)
            if grads is None:
                return self.client.report_progress(s, header)
            tensors = [
                OutTensor(n, dtype_name(grads[n].dtype), tuple(grads[n].shape), encoded[n].codec, encoded[n].payload)
                for n in self.shards[s]
            ]
            try:
                return self.client.push(s, header, tensors)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT and refusal_reason(err) == NON_FINITE:
                    log.warning("%s: shard %d refused its step %d: %s", self.ctx.replica, s, self.worker_step,
                                err.details())
                    return self.client.report_progress(s, header)
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                # The shard restarted from a checkpoint: this gradient belongs to
                # parameters it no longer has. Drop it and pull again.
                log.warning("%s: push to shard %d refused: %s", self.ctx.replica, s, err.details())
                return None

        replies = self._each_shard(one)
        counted = (pb.PushReply.APPLIED, pb.PushReply.DUPLICATE, pb.PushReply.SKIPPED)
        for s, reply in enumerate(replies):
            applied = reply is not None and reply.outcome in counted
            self.min_step[s] = self.ps_step[s] + 1 if applied and self.ps.aggregation == "Sync" else 0
        if grads is not None:
            self.metrics.gradient_bytes_total.labels(stage="raw").inc(
                sum(g.numel() * g.element_size() for g in grads.values()))
            self.metrics.gradient_bytes_total.labels(stage="compressed").inc(
                sum(e.payload.numel() for e in encoded.values()))
        return replies

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """Push one step's gradients, or, when they are not finite, skip the step (module docstring)."""
        bad = first_non_finite(grads)
        replies = self.push(None if bad is not None else grads)
        if bad is None and not any(r is not None and r.outcome == pb.PushReply.SKIPPED for r in replies):
            self.non_finite_streak = 0
            return
        if bad is None:
            # The codec made the gradient non-finite, and error feedback kept
            # what it dropped (an Inf) for the next step: forget it, or every
            # later step would be refused too. One step's deferred error is lost.
            self.compressor.residuals.clear()
        self.non_finite_streak += 1
        self.metrics.non_finite_steps_total.inc()
        what = f"tensor {bad!r} holds NaN or Inf" if bad is not None else "a shard refused its gradient as not finite"
        log.warning("%s: skipped its step %d (loss %s): %s; %d in a row", self.ctx.replica, self.worker_step,
                    self.loss, what, self.non_finite_streak)
        self.events.write("skip", step=self.ps_step[0], worker_step=self.worker_step, loss=self.loss,
                          reason="non_finite", in_a_row=self.non_finite_streak)
        if self.non_finite_streak >= MAX_CONSECUTIVE_NON_FINITE_STEPS:
            raise ConfigError(
                f"{self.ctx.replica}: gradients not finite (NaN or Inf) for {self.non_finite_streak} steps in a row, "
                f"up to its step {self.worker_step} (loss {self.loss}): training diverged; lower "
                "spec.training.optimizer.learningRate, or look for NaN or Inf in the data"
            )

    def _step_of_cursor(self) -> int:
        """This worker's step, from its cursor: the shards' record of its pushes and its Finish go by it.

        With epochs it counts back from the planned last step (`local_total`), so that the last batch of
        the cursor's epochs is that step whatever the cursor went through (an elastic job's resize deals
        a rest of an epoch of another length); at 0 when its cursor holds more than a fresh one would,
        and then it pushes past the plan. With maxSteps, whole epochs plus this one's batches."""
        if self.epochs is not None and self.local_total is not None:
            return max(0, self.local_total - self.cursor.steps_left(self.epochs))
        return self.cursor.epoch * self.cursor.steps_per_epoch + self.cursor.position // self.cursor.batch_size

    def _join(self, registration: pb.RegisterReply) -> None:
        """Take what ps-0's coordinator says of this worker: its set of workers and its cursor (the rest
        of the epoch dealt again, after a resize); released, it leaves (Released)."""
        if registration.released:
            raise Released()
        resized = registration.world_size != self.world
        self.membership, self.world = registration.membership, registration.world_size
        spec = self.ctx.spec
        if resized:
            self.cursor = self.data.cursor(self.ctx.index, self.world, spec.require_training().batch_size, spec.require_training().seed)
            self.local_total = planned_worker_steps(self.ctx, self.cursor.steps_per_epoch)
        if registration.cursor_json:
            self.cursor.load_state_dict(json.loads(registration.cursor_json))
        self.worker_step = self._step_of_cursor()
        self.redealt = bool(self.cursor.plans)
        # A new set's steps start from the shards' step as it is: no barrier of the old set applies.
        self.min_step = [0] * len(self.shards)

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_SECONDS):
            try:
                self.client.heartbeat(self.ctx.index, self.incarnation, self.worker_step)
            except grpc.RpcError:
                pass  # ps-0 restarting: pulls and pushes retry; the next heartbeat will tell

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> int:
        ctx = self.ctx
        self.metrics.process_starts_total.inc()
        self.metrics.total_steps.set(self.total_steps)
        self.metrics.serve(ctx.metrics_port, ctx.listen_address)
        registration = self.client.register(ctx.index, self.incarnation, 0, self.world)
        startup("registered", resumed=bool(registration.cursor_json))
        self._join(registration)
        self.events.write("start", step=self.worker_step, worker_step=self.worker_step,
                          total_steps=self.total_steps, device=str(self.device))
        if registration.cursor_json:
            self.events.write("resume", step=self.worker_step, worker_step=self.worker_step)
            log.info("%s: resuming at its step %d (cursor from the coordinator)", ctx.replica, self.worker_step)
        self._heartbeat_thread.start()
        interval = log_interval(self.local_total or self.total_steps)
        train_seconds, run_samples = 0.0, 0
        window_samples, window_start, logged_once = 0, time.perf_counter(), False
        while not registration.finished:
            if ctx.stop_requested:
                self.events.write("stop", step=self.ps_step[0], worker_step=self.worker_step)
                log.info("%s: stopped by SIGTERM at its step %d; its cursor is with ps-0", ctx.replica, self.worker_step)
                return EXIT_TERMINATED
            if self.epochs is not None and self.cursor.epoch >= self.epochs:
                break
            if self.place is not None and self.place.lost.is_set():
                raise TransientError(f"{ctx.replica}: {self.place.why_lost}; stopping")
            headers = self.pull()
            if self.epochs is not None and not self.cursor.steps_left(self.epochs):
                break  # dealt nothing more by a resize (a share of the last epoch's rest that came out empty)
            if self.redealt:
                # Dealt a rest of an epoch by a resize: the job ends that many of its steps past the shards' step.
                self.redealt = False
                left = self.cursor.steps_left(self.epochs) if self.epochs is not None else 0
                if left:
                    self.total_steps = self.ps_step[0] + left * (1 if self.ps.aggregation == "Sync" else self.world)
                    self.metrics.total_steps.set(self.total_steps)
            # Every shard: one restarted from a checkpoint may lag the others,
            # and it takes no Finish before it reaches maxSteps too.
            if all(h.done for h in headers):
                break
            step_start = time.perf_counter()
            self.slowdown.begin()
            batch = self.cursor.next_batch().to(self.device)
            self.loss = compute_gradients(self.model, self.train_x[batch], self.train_y[batch], self.data.objective)
            self.slowdown.after()
            self.worker_step += 1
            grads = {n: p.grad.detach().to("cpu") for n, p in self.params.items()}  # type: ignore[union-attr]
            self.step(grads)
            now = time.perf_counter()
            train_seconds += now - step_start
            self.samples += len(batch)
            run_samples += len(batch)
            window_samples += len(batch)
            self.metrics.steps_total.inc()
            startup("first_step", step=self.ps_step[0], worker_step=self.worker_step)
            self.metrics.samples_total.inc(len(batch))
            self.metrics.step_duration_seconds.observe(now - step_start)
            self.metrics.training_step.set(self.ps_step[0])
            self.metrics.loss.set(self.loss)
            ctx.maybe_fault(self.worker_step)
            if self.worker_step % interval == 0 or not logged_once:
                rate = window_samples / max(now - window_start, 1e-9)
                self.metrics.samples_per_second.set(rate)
                epoch = self.cursor.epochs_done
                self.events.write("train", step=self.ps_step[0] + 1, worker_step=self.worker_step,
                                  total_steps=self.total_steps, loss=self.loss,
                                  samples=self.samples, samples_per_second=rate, epoch=round(epoch, 4))
                window_samples, window_start, logged_once = 0, now, True
        return self.finish(run_samples / train_seconds if train_seconds else 0.0)

    def finish(self, samples_per_second: float) -> int:
        ctx = self.ctx
        result: dict[str, Any] = {}
        if ctx.index == 0:
            # Wait until every worker is done pushing, then evaluate the final parameters.
            self.pull(final=True)
            eval_loss, eval_accuracy = evaluate(self.model, self.data.eval_x, self.data.eval_y,
                                                objective=self.data.objective)
            self.metrics.eval_loss.set(eval_loss)
            self.metrics.eval_accuracy.set(eval_accuracy)
            self.events.write("eval", step=self.ps_step[0], epoch=self.cursor.epoch,
                              eval_loss=eval_loss, eval_accuracy=eval_accuracy)
            if math.isnan(eval_accuracy):  # not measured: the loss is not crossEntropy
                log.info("%s: final eval loss %.4f at step %d", ctx.replica, eval_loss, self.ps_step[0])
            else:  # tests/e2e read "final eval accuracy X" from the pod's log
                log.info("%s: final eval accuracy %.4f, loss %.4f at step %d", ctx.replica, eval_accuracy, eval_loss,
                         self.ps_step[0])
            result = {"eval_accuracy": eval_accuracy, "eval_loss": eval_loss}
        cursor_json = json.dumps(self.cursor.state_dict())
        self._each_shard(lambda s: self._finish_shard(s, cursor_json))
        wall = time.monotonic() - self.started
        write_result(ctx.run_dir, ctx.replica, {
            "steps": self.worker_step,
            "global_step": self.ps_step[0],
            "epochs": round(self.cursor.epochs_done, 4),
            "final_train_loss": self.loss,
            **result,
            "samples": self.samples,
            "samples_per_second": samples_per_second,
            "bytes_sent": self.client.counter.sent,
            "bytes_received": self.client.counter.received,
            "raw_gradient_bytes": self.compressor.raw_bytes,
            "compressed_gradient_bytes": self.compressor.compressed_bytes,
            "compression_ratio": self.compressor.ratio,
            "pull_copy_mismatches": self.copy_mismatches,
            "wall_seconds": wall,
        }, termination_log=ctx.termination_log)
        self.events.write("end", step=self.ps_step[0], worker_step=self.worker_step, wall_seconds=wall)
        return EXIT_OK

    def _finish_shard(self, s: int, cursor_json: str) -> pb.FinishReply:
        """Finish on one shard; a shard without this worker's last push on record is told it first.

        That happens when the shard restarted from a checkpoint after the
        worker's last push (its record is the checkpoint's), or when this
        process is a restart of a worker that had pushed its last step (the
        shard knows the previous incarnation). The progress report (a push
        without a gradient at the worker's last step) brings it up to date,
        and the second Finish goes through.
        """
        try:
            return self.client.finish(s, self.ctx.index, self.incarnation, cursor_json)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("%s: shard %d refused Finish (%s); reporting its step %d", self.ctx.replica, s,
                        err.details(), self.worker_step)
        header = self._header(s, cursor_json)
        header.base_step, header.ps_incarnation = 0, 0  # a report: no parameters behind it to check
        try:
            self.client.report_progress(s, header)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        return self.client.finish(s, self.ctx.index, self.incarnation, cursor_json)

    def close(self) -> None:
        # Join before closing the channel: a thread still inside gRPC when the
        # interpreter exits makes the process abort (exit -6).
        self._stop_heartbeat.set()
        if self._heartbeat_thread.is_alive():
            self._heartbeat_thread.join()
        self.pool.shutdown(wait=True)
        self.client.close()
        if self.place is not None:
            self.place.close()  # after Finish: the place of a finished worker is not handed over
        self.metrics.close()
        self.events.close()


def run_worker(ctx: ReplicaContext) -> int:
    """Train as one worker until the job's steps are done (0), ps-0 releases it at a resize (76) or
    SIGTERM (143). In a job with standby workers it holds its place at ps-0 first (standby.py), or, its
    place held by a standby that took over, waits as the next standby."""
    if not ps_spec(ctx).standby_workers:
        return run_placed(ctx, None, ctx.index)
    return run_placed(ctx, Place(ctx), ctx.index)


def run_standby(ctx: ReplicaContext) -> int:
    """A standby worker (standby.py): wait for a worker's place and run as that worker; 0 when the job's
    workers all finish first, 143 when SIGTERM comes first (a standby holds nothing to save)."""
    return run_placed(ctx, Place(ctx), -1)


def run_placed(ctx: ReplicaContext, place: Place | None, ask: int) -> int:
    """Run as worker `ask`, or, with a place to hold at ps-0, as the worker whose place it is given."""
    if place is not None:
        try:
            index = place.take(ask)
        except BaseException:
            place.close()
            raise
        if index is None:  # the job's workers all finished, or SIGTERM while waiting (stopped as any replica)
            place.close()
            return EXIT_TERMINATED if ctx.stop_requested else EXIT_OK
        if index != ctx.index or ctx.role != "worker":
            log.info("%s: takes worker-%d's place", ctx.replica, index)
            startup("placed", worker=index)
        ctx = as_worker(ctx, index)
    try:
        worker = Worker(ctx, place)
    except BaseException:
        if place is not None:
            place.close()
        raise
    try:
        return worker.run()
    except Released:
        worker.events.write("released", step=worker.ps_step[0], worker_step=worker.worker_step,
                            samples=worker.samples)
        log.info("%s: released by a resize at its step %d (the job has %d workers now); its data is dealt to "
                 "the others", ctx.replica, worker.worker_step, worker.world)
        return EXIT_RELEASED
    except grpc.RpcError as err:
        if ctx.stop_requested:
            log.info("%s: stopped by SIGTERM while a parameter server was away (%s); its cursor is with ps-0",
                     ctx.replica, err.code().name)
            return EXIT_TERMINATED
        # Retries spent (progressDeadlineSeconds) or a refusal no retry can fix.
        raise TransientError(f"{ctx.replica}: parameter server call failed: {err.code().name}: {err.details()}") from None
    finally:
        worker.close()
