"""The Single-mode trainer: one process, the whole batch stream, the baseline every mode is measured against."""

from __future__ import annotations

import contextlib
import logging
import time

from .context import ReplicaContext
from .session import JobCheckpoints, ProgressReporter
from .device import make_deterministic, select_device
from .errors import EXIT_OK, EXIT_TERMINATED, TransientError
from .events import EventLog, startup, write_result
from .metrics import TrainerMetrics
from .models import build_optimizer, evaluate, model_and_data
from .testhooks import Slowdown
from .training import StepRecipe, TrainState, planned_steps, train_step

log = logging.getLogger(__name__)


class SingleTrainer(TrainState):
    """Owns the model, optimizer, cursor and checkpoints of one Single replica."""

    def __init__(self, ctx: ReplicaContext):
        self.started = time.monotonic()
        spec = ctx.spec
        self.ctx = ctx
        self.threads = make_deterministic()
        self.device = select_device(spec.require_training().device)
        self.model, self.data = model_and_data(spec)
        startup("model")
        self.train_x = self.data.train_x.to(self.device)
        self.train_y = self.data.train_y.to(self.device)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model.parameters(), spec.require_training().optimizer)
        self.cursor = self.data.cursor(0, 1, spec.require_training().batch_size, spec.require_training().seed)
        self.total_steps = planned_steps(spec.require_training(), self.cursor.steps_per_epoch)
        self.recipe = StepRecipe.of(spec.require_training())
        self.metrics = TrainerMetrics(ctx)
        self.data.attach_metrics(self.metrics)
        self.events = EventLog(ctx.run_dir, ctx.replica)
        self.checkpoints = JobCheckpoints(ctx, self.metrics, self.events)
        self.reporter = ProgressReporter(ctx, self.metrics, self.events, self.total_steps)
        self.start_state()
        # Throughput of this process, for its results.
        self.run_samples, self.train_seconds = 0, 0.0
        self.slowdown = Slowdown.for_replica(ctx.replica)  # a benchmark's straggler (kubetrain/trainer/testhooks.py)

    # --- state -------------------------------------------------------------

    def restore(self) -> bool:
        """Continue from the newest valid checkpoint, if there is one; True when resumed."""
        found = self.checkpoints.restore()
        if found is None:
            return False
        step, state, _ = found
        self.load_state(step, state)
        return True

    def checkpoint(self) -> None:
        self.checkpoints.save(self.step, self.state())
        self.checkpoint_step = self.step

    def evaluate(self) -> None:
        self.eval_step = self.step
        self.record_eval(*evaluate(self.model, self.data.eval_x, self.data.eval_y, objective=self.data.objective))

    # --- the loop ------------------------------------------------------------

    def run(self) -> int:
        self.metrics.process_starts_total.inc()
        resumed = self.restore()
        self.reporter.start_window(self.step)  # before /metrics is served: a restarted replica never reads step 0
        self.metrics.serve(self.ctx.metrics_port, self.ctx.listen_address)
        startup("restored", step=self.step, resumed=resumed)
        if self.evaluates_baseline():
            self.evaluate()
        self.events.write("start", step=self.step, total_steps=self.total_steps, device=str(self.device),
                          threads=self.threads)
        if resumed:
            log.info("%s: resumed from step %d of %d", self.ctx.replica, self.step, self.total_steps)
        every = self.ctx.spec.checkpoint.interval_steps
        self.reporter.start_window(self.step)
        while self.step < self.total_steps:
            samples = self.train_one()
            epoch = self.cursor.epochs_done
            # After the update, before this step's checkpoint: a fault here loses the step.
            self.reporter.report(self.step, samples=samples, loss=self.loss,
                                 event_fields={"samples": self.samples, "epoch": round(epoch, 4)})
            if self.cursor.position == 0:  # an epoch just ended
                self.evaluate()
            stopping = self.ctx.stop_requested and self.step < self.total_steps
            if self.step % every == 0 or self.step == self.total_steps or stopping:
                self.checkpoint()
            if stopping:
                self.checkpoints.wait()
                self.events.write("stop", step=self.step)
                log.info("%s: stopped by SIGTERM at step %d, checkpoint written", self.ctx.replica, self.step)
                return EXIT_TERMINATED
        self.finish()
        return EXIT_OK

    def train_one(self) -> int:
        """One optimizer step; returns the batch's samples."""
        started = time.perf_counter()
        self.slowdown.begin()
        batch = self.cursor.next_batch().to(self.device)
        self.loss = train_step(self.model, self.optimizer, self.train_x[batch], self.train_y[batch],
                               self.data.objective, self.recipe, self.step, self.total_steps)
        self.slowdown.after()
        seconds = time.perf_counter() - started
        self.step += 1
        startup("first_step", step=self.step)
        self.samples += len(batch)
        self.run_samples += len(batch)
        self.train_seconds += seconds
        self.metrics.step_duration_seconds.observe(seconds)
        return len(batch)

    def finish(self) -> None:
        """Evaluate and checkpoint the final step unless done already, then write the results."""
        if self.eval_step != self.step:
            self.evaluate()
        if self.checkpoint_step != self.step:
            self.checkpoint()
        self.checkpoints.wait()
        wall = time.monotonic() - self.started
        write_result(self.ctx.run_dir, self.ctx.replica, {
            "steps": self.step,
            "epochs": round(self.step / self.cursor.steps_per_epoch, 4),
            "final_train_loss": self.loss,
            **self.eval_results(),
            "samples": self.samples,
            # Of this process only: a resumed run's earlier attempts ran at their own speed.
            "samples_per_second": self.run_samples / self.train_seconds if self.train_seconds else 0.0,
            "wall_seconds": wall,
            "bytes_sent": 0,
            "bytes_received": 0,
            "raw_gradient_bytes": 0,
            "compressed_gradient_bytes": 0,
            "checkpoint_step": self.checkpoint_step,
            "checkpoint_time": time.time(),  # durable by now: the store was waited for
        }, termination_log=self.ctx.termination_log)
        self.events.write("end", step=self.step, wall_seconds=wall)

    def close(self) -> None:
        # A checkpoint still being written reports to the event log: let it finish first.
        with contextlib.suppress(TransientError):
            self.checkpoints.wait()
        self.metrics.close()
        self.events.close()


def run_single(ctx: ReplicaContext) -> int:
    """Train the job in this one process; resumes from a checkpoint; returns the exit code."""
    trainer = SingleTrainer(ctx)
    try:
        return trainer.run()
    finally:
        trainer.close()
