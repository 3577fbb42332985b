"""One rank of a DDP group under torchrun: sharded data, averaged gradients, checkpoints via rank 0.

torchrun starts every rank with RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK and
TORCHELASTIC_RESTART_COUNT, and restarts the whole group when one rank
fails. What survives a restart is kubetrain's checkpoint, written by global
rank 0 alone: at start the first rank of every node reads the newest valid
checkpoint on its node's volume, the group agrees on the newest of those and
its holder broadcasts it, so only the volume of the node that held rank 0
needs the files (a ReadWriteOnce volume per node works) and a rank 0 that
lands on another node after a restart loses nothing.

Every step ends with one small all-reduce of (loss x samples, samples, stop):
it gives every rank the global mean loss, and turns a SIGTERM seen by any
rank into a stop of the whole group after the same step, checkpoint first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kubetrain.shared.launch import fault_armed, rank_replica

from ..context import ReplicaContext
from ..session import JobCheckpoints, ProgressReporter
from ..data import resume_group_cursor
from ..device import make_deterministic, select_device
from ..errors import EXIT_OK, EXIT_TERMINATED, ConfigError, TrainerError, TransientError, first_line
from ..events import EventLog, startup, write_result
from ..metrics import TrainerMetrics
from ..models import build_optimizer, evaluate, model_and_data
from ..testhooks import Slowdown
from ..training import StepRecipe, TrainState, planned_steps, train_step
from . import fsdp
from .hooks import CommHook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the torchrun group (torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    node: int
    """GROUP_RANK: the node's index in this rendezvous round (assigned by c10d, not by pod name)."""
    restart_count: int
    """TORCHELASTIC_RESTART_COUNT: restarts counted by this node's agent (0 on the first attempt).

    torch counts per agent: a node whose ranks were restarted because another
    node failed may still say 0 (pytorch#135712). The `start` events of a
    rank count the attempts reliably.
    """

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Topology":
        missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in env]
        if missing:
            raise ConfigError(
                f"python -m kubetrain.trainer ddp runs under torchrun, which sets {', '.join(missing)}; "
                "start DDP jobs with `kubetrain run` or the operator"
            )
        try:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env["LOCAL_RANK"]),
                node=int(env.get("GROUP_RANK", "0")),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            )
        except ValueError as err:
            raise ConfigError(f"torchrun environment: {err}") from None


def select_ddp_device(spec: Any, local_rank: int) -> torch.device:
    """The device of a rank: cuda:<local rank> for nccl (which needs it), else spec.training.device."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec.ddp.backend == "nccl":
        if visible <= local_rank:
            raise ConfigError(
                f"spec.ddp.backend: nccl needs one GPU per rank, but local rank {local_rank} sees {visible} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); "
                "use gloo to train on CPUs"
            )
        device = torch.device("cuda", local_rank)
    else:
        device = select_device(spec.training.device)
        if device.type == "cuda":
            device = torch.device("cuda", local_rank % visible)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class DDPTrainer(TrainState):
    """Owns the model, optimizer, cursor, hook and (on rank 0) checkpoints of one rank."""

    reads_checkpoint_at_start = True
    """Read this node's newest checkpoint before joining the group (a fault-tolerant group may heal instead)."""
    COUNTERS = (*TrainState.COUNTERS, "bytes_sent", "raw_gradient_bytes")
    bytes_sent: int
    raw_gradient_bytes: int
    """Beside the samples and the loss, a checkpoint carries the gradient bytes: a resumed rank's results count
    the whole run's."""

    def __init__(self, ctx: ReplicaContext, topo: Topology):
        self.started = time.monotonic()
        spec = ctx.spec
        self.topo = topo
        self.node_replica = ctx.replica
        self.rank, self.world_size = self.placement(topo, spec)
        replica = rank_replica(self.rank)
        self.ctx = dataclasses.replace(
            ctx,
            replica=replica,
            role="ddp",
            index=topo.rank,
            fault_step=ctx.fault_step if fault_armed(os.environ, replica) else None,
            fault_save=ctx.fault_save if fault_armed(os.environ, replica) else None,
            fault_allreduce=ctx.fault_allreduce if fault_armed(os.environ, replica) else None,
        )
        # The SIGTERM handler must set the flag of the context this loop reads.
        self.ctx.install_signal_handlers()
        self.chief = self.rank == 0
        self.threads = make_deterministic()
        self.device = select_ddp_device(spec, topo.local_rank)
        # strategy FSDP: the model is sharded when the group is joined, and every
        # rank saves its own shards (checkpoints through the sharded path). A
        # pretrained causal-lm stays on the meta device until it is sharded: no
        # rank ever holds all of its weights (causal_lm.py).
        self.fsdp = spec.require_ddp().strategy == "FSDP"
        self.model, self.data = model_and_data(spec, meta=self.fsdp)
        startup("model", rank=topo.rank)
        self.train_x = self.data.train_x.to(self.device)
        self.train_y = self.data.train_y.to(self.device)
        if getattr(self.model, "materialized", True):
            self.model.to(self.device)
        self.optimizer = build_optimizer(self.model.parameters(), spec.require_training().optimizer)
        self.cursor = self.make_cursor()
        self.total_steps = planned_steps(spec.require_training(), self.cursor.steps_per_epoch)
        self.recipe = StepRecipe.of(spec.require_training())
        self.metrics = TrainerMetrics(self.ctx)
        self.data.attach_metrics(self.metrics)
        self.events = EventLog(ctx.run_dir, replica)
        # The first rank of each node reads its node's volume; only rank 0 writes.
        self.checkpoints = JobCheckpoints(self.ctx, self.metrics, self.events,
                                          reader=topo.local_rank == 0, writer=self.writes_checkpoints(),
                                          nodes=max(1, topo.world_size // spec.require_ddp().procs_per_node))
        self.reporter = ProgressReporter(self.ctx, self.metrics, self.events, self.total_steps)
        # Read before joining the group: a bad checkpoint (another spec) fails
        # this rank at once, and torchrun then stops the others.
        self.found = self.checkpoints.load_local() if self.reads_checkpoint_at_start else None
        self.ddp: torch.nn.Module | None = None  # DDP's wrapper, or the FSDP-sharded model itself
        self.hook: CommHook | None = None
        self.start_state()
        self.slowdown = Slowdown.for_replica(replica)  # a benchmark's straggler (kubetrain/trainer/testhooks.py)

    def placement(self, topo: Topology, spec: Any) -> tuple[int, int]:
        """(rank, ranks) that name this process and deal its data: torchrun's own in one group of every node."""
        if topo.world_size != spec.world_size:
            raise ConfigError(
                f"spec.ddp: nodes x procsPerNode = {spec.ddp.nodes} x {spec.ddp.procs_per_node} = "
                f"{spec.world_size} ranks, but torchrun started {topo.world_size}"
            )
        return topo.rank, topo.world_size

    def make_cursor(self) -> Any:
        """This rank's way through the samples: its own shard of every epoch."""
        training = self.ctx.spec.require_training()
        return self.data.cursor(self.rank, self.world_size, training.batch_size, training.seed)

    def writes_checkpoints(self) -> bool:
        """Global rank 0 alone writes: the state is the same on every rank."""
        return self.chief

    # --- the group ---------------------------------------------------------------

    def join(self) -> None:
        """Join the process group, wrap the model in DDP and register the communication hook."""
        spec = self.ctx.spec
        # A collective that waits longer than the progress deadline is a hang;
        # failing it lets torchrun restart the group.
        dist.init_process_group(
            spec.require_ddp().backend, timeout=timedelta(seconds=spec.run_policy.progress_deadline_seconds)
        )
        startup("joined", rank=self.topo.rank)  # every rank of the group connected
        if self.fsdp:
            fsdp.shard(self.model, self.device, self.topo.world_size)
            if not getattr(self.model, "materialized", True):
                self.model.materialize(self.device)  # type: ignore[operator]
            # The optimizer must hold the sharded parameters (DTensors), which replaced the model's own.
            self.optimizer = build_optimizer(self.model.parameters(), spec.require_training().optimizer)
            self.ddp = self.model
            return
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device] if self.device.type == "cuda" else None
        )
        self.hook = CommHook(
            spec.require_ddp().comm_hook,
            dist.group.WORLD,  # type: ignore[arg-type]  # set by init_process_group above
            powersgd_rank=spec.require_ddp().power_sgd_rank,
            total_steps=self.total_steps,
            seed=spec.require_training().seed,
        )
        self.hook.register(self.ddp)

    def leave(self) -> None:
        # DDP's reducer holds the hook and its Python process group; both must
        # go before the group is destroyed, or the C++ side aborts at exit
        # ("terminate called without an active exception").
        self.ddp = None
        self.hook = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- state -------------------------------------------------------------------

    def weights_state(self) -> tuple[Any, Any, Any]:
        if not self.fsdp:
            return super().weights_state()
        model, optimizer = fsdp.model_state(self.model, self.optimizer)
        # One value, not a dict: a sharded restore loads the keys of its template, and
        # the cursor's keys vary (an epoch dealt again after a resize adds `plans`).
        return model, optimizer, json.dumps(self.cursor.state_dict())

    def restore(self) -> None:
        """Agree on the newest checkpoint any node holds; its holder broadcasts it to all."""
        template = self.state() if self.fsdp else None
        found = self.checkpoints.restore(dist.group.WORLD, self.topo.world_size, self.topo.rank, self.found,
                                         template=template)
        self.found = None
        if found is None:
            return
        step, state, source = found
        if self.fsdp:
            fsdp.load_model_state(self.model, self.optimizer, state["model"], state["optimizer"])
            state["cursor"] = json.loads(state["cursor"]) if isinstance(state["cursor"], str) else state["cursor"]
        self.load_state(step, state, weights=not self.fsdp)
        log.info("%s: resumed from step %d of %d (%s)", self.ctx.replica, step, self.total_steps,
                 f"checkpoint of rank {source}" if source is not None else "sharded checkpoint")

    def load_cursor(self, saved: dict[str, Any]) -> None:
        # Every rank is at the same epoch and position; only the shard differs (or, when the group was
        # resized, what was left of the epoch is dealt again among the new ranks).
        if resume_group_cursor(self.cursor, saved):
            self.total_steps = self.planned_total()
            self.reporter.set_total(self.total_steps)
            log.info("%s: the group was resized from %d to %d ranks: the rest of epoch %d dealt again, %d steps "
                     "left", self.ctx.replica, saved["world_size"], self.topo.world_size, self.cursor.epoch,
                     self.total_steps - self.step)

    def planned_total(self) -> int:
        """The step training ends at: maxSteps, or where the cursor finishes its epochs (after a resize the
        epoch in progress has another length than a whole one at this size)."""
        training = self.ctx.spec.require_training()
        if training.max_steps is not None:
            return training.max_steps
        return self.step + self.cursor.steps_left(training.effective_epochs or 0)

    def checkpoint(self) -> None:
        # Every rank calls it. DDP: rank 0 alone writes (the state is the same on all);
        # FSDP: every rank writes its own shards.
        self.checkpoints.save(self.step, self.state() if self.chief or self.fsdp else {})
        self.checkpoint_step = self.step

    def wait_checkpoint(self) -> None:
        """Rank 0's last checkpoint is durable on return, on every rank."""
        self.checkpoints.wait()
        dist.barrier()

    def result(self, wall: float, run_samples: int, train_seconds: float) -> dict[str, Any]:
        """The figures of this rank's results file every DDP loop writes."""
        return {
            "steps": self.step,
            "epochs": round(self.cursor.epochs_done, 4),
            "final_train_loss": self.loss,
            "samples": self.samples,
            "samples_per_second": run_samples / train_seconds if train_seconds else 0.0,
            "wall_seconds": wall,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_sent,
        }

    def final_checkpoint(self) -> float:
        """The end of the loop: the final model evaluated and checkpointed (durable on return); the wall
        seconds of the process so far."""
        if self.eval_step != self.step:
            self.evaluate()
        if self.checkpoint_step != self.step:
            self.checkpoint()
        self.wait_checkpoint()
        return time.monotonic() - self.started

    def evaluate(self) -> None:
        """The chief evaluates; the others only note that the step was evaluated (under FSDP every rank
        runs the forward passes with it: each gathers its share of every layer)."""
        self.eval_step = self.step
        if not self.chief and not self.fsdp:
            return
        eval_loss, eval_accuracy = evaluate(self.model, self.data.eval_x, self.data.eval_y,
                                            objective=self.data.objective)
        if self.evaluates_baseline():  # every rank that evaluates: each FSDP rank writes it with its shards
            self.baseline_eval_loss = eval_loss
        if not self.chief:
            return
        self.record_eval(eval_loss, eval_accuracy)

    # --- the loop ----------------------------------------------------------------

    def sync_step(self, loss: float, samples: int) -> tuple[float, bool]:
        """All-reduce (loss x samples, samples, stop): the global mean loss, and whether any rank must stop."""
        control = torch.tensor(
            [loss * samples, float(samples), 1.0 if self.ctx.stop_requested else 0.0],
            dtype=torch.float64, device=self.device,
        )
        dist.all_reduce(control)
        total_loss, total_samples, stops = control.tolist()
        return total_loss / total_samples, stops > 0

    def run(self) -> int:
        self.metrics.process_starts_total.inc()
        port = self.ctx.metrics_port
        self.metrics.serve(port + self.topo.local_rank if port else 0, self.ctx.listen_address)
        self.join()
        assert self.ddp is not None and (self.hook is not None or self.fsdp)
        self.restore()
        startup("restored", rank=self.topo.rank, step=self.step)
        if self.evaluates_baseline():
            self.evaluate()
        spec = self.ctx.spec
        self.events.write(
            "start", step=self.step, total_steps=self.total_steps, device=str(self.device), threads=self.threads,
            rank=self.topo.rank, world_size=self.topo.world_size, node=self.topo.node, pid=os.getpid(),
            node_replica=self.node_replica, agent_restart_count=self.topo.restart_count,
            backend=spec.require_ddp().backend, comm_hook=spec.require_ddp().comm_hook, strategy=spec.require_ddp().strategy,
        )
        run_samples, train_seconds = 0, 0.0
        self.reporter.start_window(self.step)
        while self.step < self.total_steps:
            step_start = time.perf_counter()
            self.slowdown.begin()
            batch = self.cursor.next_batch().to(self.device)
            local_loss = train_step(self.ddp, self.optimizer, self.train_x[batch], self.train_y[batch],
                                    self.data.objective, self.recipe, self.step, self.total_steps)
            self.slowdown.after()
            # FSDP's traffic (gathers and reduce-scatters) is not counted: no hook sees it.
            raw, sent = self.hook.end_step() if self.hook is not None else (0, 0)
            self.loss, stop = self.sync_step(local_loss, len(batch))
            self.step += 1
            startup("first_step", rank=self.topo.rank, step=self.step)
            self.samples += len(batch)
            self.raw_gradient_bytes += raw
            self.bytes_sent += sent
            run_samples += len(batch)
            now = time.perf_counter()
            train_seconds += now - step_start
            self.metrics.step_duration_seconds.observe(now - step_start)
            self.metrics.gradient_bytes_total.labels(stage="raw").inc(raw)
            self.metrics.gradient_bytes_total.labels(stage="compressed").inc(sent)
            self.metrics.network_bytes_total.labels(direction="sent").inc(sent)
            self.metrics.network_bytes_total.labels(direction="received").inc(sent)
            epoch = self.cursor.epochs_done
            # After the update, before this step's checkpoint: a fault here loses the step.
            self.reporter.report(self.step, samples=len(batch), loss=self.loss, event_fields={
                "local_loss": local_loss, "samples": self.samples, "epoch": round(epoch, 4)})
            if self.cursor.position == 0:  # an epoch just ended
                self.evaluate()
            if self.step % spec.checkpoint.interval_steps == 0 or self.step == self.total_steps or stop:
                self.checkpoint()
            if stop and self.step < self.total_steps:
                self.wait_checkpoint()
                self.events.write("stop", step=self.step)
                log.info("%s: stopped by SIGTERM at step %d, checkpoint written", self.ctx.replica, self.step)
                return EXIT_TERMINATED
        wall = self.final_checkpoint()
        result: dict[str, Any] = {
            **self.result(wall, run_samples, train_seconds),
            "raw_gradient_bytes": self.raw_gradient_bytes,
            "compressed_gradient_bytes": self.bytes_sent,
            "compression_ratio": self.raw_gradient_bytes / self.bytes_sent if self.bytes_sent else None,
            "rank": self.topo.rank,
            "world_size": self.topo.world_size,
            "agent_restart_count": self.topo.restart_count,
            "comm_hook": self.hook.stats() if self.hook is not None else None,
            "strategy": spec.require_ddp().strategy,
        }
        if self.chief:
            result.update(**self.eval_results(), checkpoint_step=self.checkpoint_step, checkpoint_time=time.time())
        # One process per pod speaks in its termination message: the chief (ranks share the file).
        write_result(self.ctx.run_dir, self.ctx.replica, result,
                     termination_log=self.ctx.termination_log if self.chief else None)
        self.events.write("end", step=self.step, wall_seconds=wall)
        return EXIT_OK

    def close(self) -> None:
        # A checkpoint still being written reports to the event log: let it finish first.
        with contextlib.suppress(TransientError):
            self.checkpoints.wait()
        self.leave()
        self.metrics.close()
        self.events.close()


def run_group_rank(ctx: ReplicaContext) -> int:
    """Train as one rank of the torchrun group (plain DDP: `entry.run_ddp` chose it); resumes from the
    newest checkpoint; returns the exit code.

    0 when the job is done, 143 after a SIGTERM (checkpoint written), 2 for a
    configuration that cannot work (nccl without a GPU), 75 when a collective
    failed (DistError: a peer hung or its store went away), 1 for any other
    failure (gloo reports a dead peer as a plain RuntimeError). torchrun
    restarts the group whatever the code; the codes matter once it gives up.
    """
    topo = Topology.from_env(os.environ)
    trainer = DDPTrainer(ctx, topo)
    failure, error_type = "", TrainerError
    try:
        return trainer.run()
    except TrainerError:
        raise
    except Exception as err:
        if isinstance(err, dist.DistError):
            error_type = TransientError
        # Logged, then dropped before the group is torn down: a live traceback
        # holds the failed backward's frames, and with them gloo work that
        # made the interpreter hang at exit until torchrun's SIGKILL (30 s).
        log.error("%s: training failed:\n%s", trainer.ctx.replica, "".join(traceback.format_exception(err)))
        failure = f"{type(err).__name__}: {first_line(err)}"
    finally:
        trainer.close()
    raise error_type(f"{trainer.ctx.replica}: training failed: {failure}")
