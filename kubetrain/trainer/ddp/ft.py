"""Fault-tolerant DDP (spec.ddp.faultTolerance): replica groups that train on when one of them dies.

Each DDP node is a replica group: its procsPerNode ranks are one torchrun group of their own inside the
node, and torchft's Manager joins the groups. A Lighthouse (one per job: `lighthouse.py`) forms the quorum
of the groups alive before every step; a group that dies is out of the next quorum once its heartbeats
stop (`heartbeatTimeoutSeconds`), and the others commit their next step without it. Its replacement
copies the model and the optimizer from a live group over HTTP (a heal), without reading a checkpoint.
kubetrain's own checkpoints (every group writes its own) remain for the loss of every group.

One step of a group (`ReplicaGroup`), for the built-in loop (`FaultTolerantTrainer`) and for a user's
script (`FaultTolerance`, `import kubetrain`) alike:

1. `begin`: the step's quorum starts in the background (torchft's async quorum, beside the forward pass);
2. the forward and backward pass on the group's batch of that step;
3. `average`: the gradients, with the loss, as one flat tensor, averaged within the group
   (torch.distributed, when it has more than one rank) and then across the quorum's groups by
   `Manager.allreduce`. A peer that dies in the middle of it fails the allreduce; the Manager records
   the error instead of raising it;
4. `commit`: the group's ranks vote (`Manager.should_commit`, what torchft's OptimizerWrapper.step
   asks): a step whose average failed, or that fewer than minReplicas groups took part in, is
   discarded, never fatal, and the optimizer steps only when it commits.

torchft's own DistributedDataParallel wrapper is not used: its communication hook asserts
(`assert fut._fut`, torchft/ddp.py) when a peer dies in the middle of an allreduce, and the survivor
crashed (2 runs of 2 on this machine, torchft 0.2.0); the allreduce of one flat tensor discards that
step instead.

Restore or heal, decided by the first quorum (`ReplicaGroup.join`): a group starts at step 0 without
reading anything. If its first quorum holds a group at a later step, it heals from it (the normal
path of a replacement: no checkpoint read). If every group of that quorum is at step 0 (a new job, or
every group was lost), each reads its own newest checkpoint and they ask for a quorum again at the steps
they restored: those behind heal from the newest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.shared.launch import (FT_GROUPS_VAR, FT_GROUP_VAR, FT_HOLD_VAR,
                                       FT_LIGHTHOUSE_VAR, FT_STORE_VAR, rank_replica)

from ..context import ReplicaContext
from ..session import JobCheckpoints
from ..testhooks import Hold, counts_samples, join_delay
from ..data import Block, QuorumCursor
from ..errors import EXIT_OK, EXIT_TERMINATED, ConfigError, TrainerError, TransientError, first_line
from ..events import EventLog, startup, write_result
from ..metrics import TrainerMetrics
from ..preload import optimizer_step
from ..models import build_optimizer
from ..training import compute_gradients, planned_steps
from ..sharded import has_dtensors
from . import fsdp
from .runtime import DDPTrainer, Topology

log = logging.getLogger(__name__)

QUORUM_RETRIES = 10
"""Times a group's Manager server asks the Lighthouse again for a quorum that failed (the Lighthouse
restarting, its Service not routing yet) before the group gives up on the step's quorum; then it exits
75 and is restarted from a peer or its checkpoint. torchft waits 100 ms between tries: about 1 s, a
Lighthouse restarted at once is back sooner (it starts in milliseconds: lighthouse.py)."""
GATHER_POLL_SECONDS = 0.1
"""Between two first quorums at the job's start while groups are missing (`ReplicaGroup._gather`): the
Lighthouse's own tick; each quorum is a round trip to it."""
ERROR_CHARS = 300
"""The length of a discarded step's error in its `discard` event: the exception's first line (the
traceback goes to the log)."""
HOLD_POLL_SECONDS = 0.2
"""Between two quorums of a held step (`Hold`): each is a round trip to the Lighthouse and a process group
set up again (a step that does not commit moves the quorum on); a replacement that asked to join waits
at most this long for the next one."""


@dataclass(frozen=True)
class GroupPlace:
    """Where a rank sits: its replica group and its rank in it (kubetrain/shared/launch.py's FT_* variables, torchrun's)."""

    group: int
    groups: int
    """The most replica groups the job can have (ddp.maxNodes, else nodes, and the spare groups): global ranks are
    numbered within them. The data is dealt by each step's quorum (QuorumCursor), not by this."""
    local_rank: int
    local_world: int
    lighthouse: str
    store_host: str
    store_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "GroupPlace":
        missing = [v for v in (FT_LIGHTHOUSE_VAR, FT_GROUP_VAR, FT_GROUPS_VAR, FT_STORE_VAR) if not env.get(v)]
        if missing:
            raise ConfigError(f"{', '.join(missing)}: not set; a fault-tolerant DDP rank is started by kubetrain "
                              "(`kubetrain run` or the operator), which sets them")
        host, _, port = env[FT_STORE_VAR].rpartition(":")
        try:
            place = cls(group=int(env[FT_GROUP_VAR]), groups=int(env[FT_GROUPS_VAR]),
                        local_rank=int(env.get("RANK", "0")), local_world=int(env.get("WORLD_SIZE", "1")),
                        lighthouse=env[FT_LIGHTHOUSE_VAR], store_host=host, store_port=int(port))
        except ValueError as err:
            raise ConfigError(f"{FT_GROUP_VAR}, {FT_GROUPS_VAR}, {FT_STORE_VAR}, RANK, WORLD_SIZE: {err}") from None
        if not host or not 0 <= place.group < place.groups:
            raise ConfigError(f"{FT_GROUP_VAR}={place.group} {FT_GROUPS_VAR}={place.groups} "
                              f"{FT_STORE_VAR}={env[FT_STORE_VAR]!r}: expected a group below the groups and host:port")
        return place

    @property
    def rank(self) -> int:
        """The global rank: it names the rank's metrics, events and results (`ddp-<rank>`) and deals its data."""
        return self.group * self.local_world + self.local_rank

    @property
    def ranks(self) -> int:
        return self.groups * self.local_world


TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
"""torchft's Python loggers: INFO writes several lines every step (each quorum, each commit vote); a
replica's log keeps their warnings and errors (a discarded step's exception), and kubetrain's own
lines and events say when the quorum changed, a step was discarded or a group healed."""


def quiet_torchft(environ: dict[str, str] | Any = os.environ) -> None:
    """torchft's Rust side (the Manager server, the Lighthouse) logs every quorum request at INFO:
    warnings only, unless RUST_LOG asks for more. Set before its module is loaded."""
    environ.setdefault("RUST_LOG", "warn")
    for name in TORCHFT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def load_torchft() -> Any:
    """torchft, imported once it is needed (a few seconds); a clear error where it is not installed."""
    quiet_torchft()
    try:
        import torchft
    except ImportError as err:
        raise ConfigError(f"spec.ddp.faultTolerance needs torchft (the trainer image has it): {err}") from None
    return torchft


def advertised_transport(timeout: timedelta, listen: str, advertise: str) -> Any:
    """torchft's HTTP checkpoint transport (a healing group fetches the model from a live one) on the
    rank's listen address, naming the address the other groups reach it at.

    torchft's own binds every interface and names the host by `socket.gethostname()`: in a pod that is
    the pod's bare name, which the other pods cannot resolve (only `<pod>.<service>` is in DNS), and on
    this machine a local run would serve its model to the network. The server is made again on
    `listen` with torchft's request handler; the rest of the transport is torchft's.
    """
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        _server: Any  # HTTPTransport's, made again below
        _thread: threading.Thread

        def __init__(self) -> None:
            super().__init__(timeout=timeout, num_chunks=0)
            # torchft's handler, without a line on stderr for every request a healing peer makes.
            handler = type("Handler", (self._server.RequestHandlerClass,), {"log_message": lambda *args: None})
            self._server.shutdown()
            self._thread.join()
            self._server.server_close()
            family = socket.AF_INET6 if ":" in listen else socket.AF_INET
            server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family})
            self._server = server_class((listen, 0), handler)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

        def address(self) -> str:
            host = f"[{advertise}]" if ":" in advertise else advertise
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return AdvertisedHTTPTransport()


class QuorumRecorder:
    """torchft's ManagerClient, keeping the last quorum it was given (`_quorum`); everything else passes through."""

    def __init__(self) -> None:
        self.client: Any = None
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self.client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def step_salted(pg_class: type, recorder: QuorumRecorder) -> Any:
    """torchft's process group between the groups, its store prefix made unique to the quorum's step too.

    torchft keys a quorum's rendezvous in the primary group's store by the quorum's id alone
    (`torchft/<quorum id>/<group rank>`), and the Lighthouse numbers its quorums from 1 again when it is
    restarted: a later quorum with another set of groups found the keys an earlier one of the same id had
    left there, its groups dialled addresses of that old quorum, and they hung for the process group's
    timeout (60 s) again and again until a group gave up (seen here after a Lighthouse was killed). The
    step every member of a quorum is told (`max_step`) only grows while the Lighthouse lives and is past
    every step before its restart, so id and step together never name two quorums.
    """

    class StepSalted(pg_class):  # type: ignore[misc, valid-type]
        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            quorum = recorder.last
            if quorum is not None:
                store_addr = f"{store_addr}/step{quorum.max_step}"
            super().configure(store_addr, *args, **kwargs)

    return StepSalted


class ReplicaGroup:
    """One rank's side of torchft: the Manager, the step protocol, heals, the lazy restore, its events.

    `state()` and `load(state)` are the owner's: what a healing peer receives and what a checkpoint
    holds (the Manager's own step counters are added under "torchft"). A group of more than one rank
    averages within itself over torch.distributed's default group, which the owner initialises.
    """

    def __init__(self, ctx: ReplicaContext, place: GroupPlace, metrics: TrainerMetrics, events: EventLog,
                 checkpoints: JobCheckpoints, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None], device: torch.device):
        self.ctx, self.place, self.device = ctx, place, device
        self.metrics, self.events, self.checkpoints = metrics, events, checkpoints
        self._state, self._load = state, load  # the owner's: what a healing peer receives, a checkpoint holds
        self.spec = ctx.spec.require_fault_tolerance()
        self.manager: Any = None
        self.pg: Any = None
        self._quorum_pending = False  # join() started the first step's quorum already
        self._heal_started: float | None = None
        self.participants: int | None = None
        self._last_commit: float | None = None
        self._discarded_since_commit = 0
        self._participants_at_commit: int | None = None
        self.last_error = ""
        self.last_bytes = 0
        """Bytes of the last step's average (sent, and received, by this rank)."""
        self.held_step = 0
        """The step of the state this group holds: restored, healed or committed."""
        self.hold = Hold.from_env(os.environ)
        self._hold_since: float | None = None

    # --- joining -------------------------------------------------------------------

    def join(self) -> int:
        """Make the Manager (it heartbeats the Lighthouse from now on), then the first quorum: heal from a
        live group, or, when every group of the quorum is at step 0, restore this group's own newest
        checkpoint and ask again. Returns the step the group starts from (before any heal of the next step)."""
        torchft = load_torchft()
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        time.sleep(join_delay(os.environ, self.place.group))
        ft = self.spec
        timeout = timedelta(seconds=ft.timeout_seconds)
        quorum_timeout = timedelta(seconds=ft.quorum_timeout_seconds)
        # Gloo between groups unless the job runs NCCL (GPUs; not verified on this project's machines).
        recorder = QuorumRecorder()
        pg_class = ProcessGroupNCCL if self.ctx.spec.require_ddp().backend == "nccl" else ProcessGroupGloo
        self.pg = step_salted(pg_class, recorder)(timeout=timeout)
        self.manager = torchft.Manager(
            pg=self.pg,
            load_state_dict=self._from_peer,
            state_dict=self._for_peer,
            min_replica_size=ft.min_replicas,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=quorum_timeout,
            rank=self.place.local_rank,
            world_size=self.place.local_world,
            store_addr=self.place.store_host,
            store_port=self.place.store_port,
            lighthouse_addr=self.place.lighthouse,
            replica_id=f"ddp-{self.place.group}",
            hostname=self.place.store_host,
            checkpoint_transport=advertised_transport(timeout, self.ctx.listen_address, self.place.store_host),
            init_sync=False,  # every group builds the same initial weights from spec.training.seed
            quorum_retries=QUORUM_RETRIES,
        )
        recorder.client, self.manager._client = self.manager._client, recorder  # before any quorum is asked for
        startup("manager", rank=self.place.rank)
        self._gather()
        if self.manager.current_step() == 0:
            # Every group of this quorum is at step 0: each restores its own newest checkpoint, if any,
            # and, when any of them did, they all ask again at the steps they hold, so that those behind
            # heal from the newest. When none did, the first step is trained under the quorum they left
            # together: a group that came up meanwhile joins at the next step's quorum, and heals.
            found = self._restore_checkpoint()
            if found is not None:
                step, state = found
                self._load(state)
                self.manager.load_state_dict(state["torchft"])
                self.held_step = step
                log.info("%s: restored step %d from this group's checkpoint", self.ctx.replica, step)
            restored = self._any_group(found is not None)
            if restored is not False:  # True, or None: the vote failed (a peer went away): ask again anyway
                self._start_quorum()
        self._quorum_pending = True
        return self.manager.current_step()

    def _gather(self) -> None:
        """The first quorums, until one holds a group ahead of this one (it heals from it at its first
        step) or, while every group is at step 0, until all the job's groups (ddp.nodes and the spare groups
        when this process started) take part or one of the quorum's groups has waited joinTimeoutSeconds: at
        the start the groups come up seconds apart (the interpreter, torch, the data, a pod's start), and the
        first would otherwise train alone on its shard while the others start. Every group of such a quorum
        asks again; none has trained yet.

        The groups of a quorum leave it together: whether any of them waited long enough is voted on in the
        quorum (`_any_group`). Each by its own clock, a group that came up later asked again while the first
        trained the first step, and that step waited for it until timeoutSeconds (a discarded step, and in
        the soak a group that found no quorum and restarted)."""
        wanted = self.ctx.spec.require_ddp().groups
        started = time.monotonic()
        deadline = started + self.spec.join_timeout_seconds
        while True:
            self._start_quorum()
            self._wait_quorum()
            if self.manager.errored() is None:
                if self.manager.current_step() > 0 or self.manager.num_participants() >= wanted:
                    return  # the same for every group of the quorum: its steps and its size are theirs
                leave = self._any_group(time.monotonic() >= deadline)
                if leave:
                    return
                if leave is not None:
                    time.sleep(GATHER_POLL_SECONDS)
                    continue
            # Its process group could not be set up, or the vote failed (a peer of it went away
            # meanwhile): ask again, as long as a quorum may take.
            if time.monotonic() - started > self.spec.quorum_timeout_seconds:
                raise TransientError(f"{self.ctx.replica}: no working quorum within quorumTimeoutSeconds "
                                     f"({self.spec.quorum_timeout_seconds:g} s): {self._error()}")
            log.warning("%s: a first quorum failed (%s); asking again", self.ctx.replica, self._error())
            time.sleep(GATHER_POLL_SECONDS)

    def _any_group(self, flag: bool) -> bool | None:
        """Whether any rank of any group of this quorum says so (a vote at step 0, before any group trained):
        the same answer for all of them, or None when the vote failed (a peer went away in it)."""
        box = torch.tensor([1.0 if self.agree(flag) else 0.0], device=self.device)
        work = self.manager.allreduce(box, reduce_op=dist.ReduceOp.MAX)
        failed = not work.wait() or self.manager.errored() is not None
        if failed:
            self.pg.abort()  # as `average` does: peers still in the vote fail now, not at timeoutSeconds
        if not self.agree(failed):
            return bool(box.item() > 0)
        # Every rank of the group votes no on step 1, as for a discarded step: the Lighthouse then gives the
        # next quorum a new id, and every group sets up a new process group for it.
        if not failed:
            self.manager.report_error(RuntimeError("a peer rank's vote failed"))
        self.manager.should_commit()
        return None

    def _restore_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        fresh = self.checkpoint_state()
        template = fresh if has_dtensors(fresh) else None  # HSDP: the group's sharded checkpoint, rank by rank
        if self.place.local_world > 1 or template is not None:
            found = self.checkpoints.restore(dist.group.WORLD, self.place.local_world, self.place.local_rank,
                                             self.checkpoints.load_local(), template=template)
        else:
            found = self.checkpoints.restore()
        return (found[0], found[1]) if found is not None else None

    # --- one step ------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps the job has committed, as this group knows it (a heal moves it to the peers')."""
        return self.manager.current_step()

    def begin(self) -> None:
        """The step's quorum starts in the background (the first step's was started by `join`)."""
        if self._quorum_pending:
            self._quorum_pending = False
            return
        self._start_quorum()

    def _start_quorum(self) -> None:
        self._heal_started = time.monotonic()
        self.manager.start_quorum()

    def _wait_quorum(self) -> None:
        try:
            self.manager.wait_quorum()
        except Exception as err:  # noqa: BLE001 - torchft raises what its Lighthouse call raised
            # No quorum within quorumTimeoutSeconds (fewer than minReplicas groups, the Lighthouse gone
            # past its retries): this group cannot go on; restarted, it heals from a peer or restores.
            raise TransientError(f"{self.ctx.replica}: no quorum of replica groups within "
                                 f"{self.spec.quorum_timeout_seconds:g} s (ddp.faultTolerance.quorumTimeoutSeconds): "
                                 f"{first_line(err)}") from None

    def deal(self) -> tuple[int, int, int]:
        """Wait for the step's quorum: (this rank's lane among the ranks that train the step, -1 when it trains
        nothing: a spare, or a group healing in it; how many ranks train; the groups that take part).

        Every group of the quorum is told the same ranks (torchft's, by group): with spare groups the first
        ddp.nodes of them train, without, all of them (a resized job's groups may disagree on ddp.nodes)."""
        self._wait_quorum()
        rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        ddp = self.ctx.spec.require_ddp()
        training = min(participants, ddp.nodes) if self.spec.spare_groups else participants
        width = self.place.local_world
        lane = rank * width + self.place.local_rank if rank is not None and rank < training else -1
        return lane, max(training, 1) * width, participants

    def scale_share(self, params: Sequence[torch.Tensor], trained: int, block: Block, participants: int) -> None:
        """Scale this rank's mean gradient over its `trained` samples of `block` so that the average over every
        rank of the quorum's groups (the group's, then torchft's over the groups) is the mean over the block's
        samples: exactly 1 when every rank trains a full share and no spare takes part."""
        scale = trained * participants * self.place.local_world / block.size if block.size else 0.0
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)

    def average(self, params: Sequence[torch.Tensor], values: list[float]) -> list[float]:
        """Average the gradients of `params` (a missing one counts as zeros) and `values` over the group's
        ranks and then the quorum's groups, the gradients in place; returns the averaged values. A failed
        average leaves them undefined: `commit` then discards the step.

        Sharded parameters (FSDP2 within the group: HSDP) are averaged within the group by FSDP's own
        reduce-scatter already: each rank averages its local shards with the same rank of the other groups
        (torchft's process group of each rank), and only the values within the group."""
        self._wait_quorum()
        sharded = any(isinstance(p, DTensor) for p in params)
        locals_ = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
        count = len(values)
        flat = torch.cat([g.reshape(-1) for g in locals_]
                         + [torch.tensor(values, dtype=locals_[0].dtype, device=self.device)])
        if self.place.local_world > 1:
            within = flat[flat.numel() - count:] if sharded else flat
            dist.all_reduce(within)
            within /= self.place.local_world
        self.participants = self.manager.num_participants()
        self.metrics.ft_quorum_participants.set(self.participants)
        work = self.manager.allreduce(flat)
        self.ctx.maybe_fault_in_allreduce(self.step + 1)  # a fault test's kill, in the middle of it
        if not work.wait() or self.manager.errored() is not None:
            # A peer failed in it. Other survivors may still wait in the same collective for this
            # rank's part (a ring passes through every rank): closing this rank's connections fails
            # it for them now. Left open, they waited until the next quorum formed without them
            # (joinTimeoutSeconds: 5.1 s seen here, against 1.07 s for survivors that failed at
            # once). The next quorum has a new id (the Lighthouse moves it on a commit failure),
            # so every group sets up a new process group for it.
            self.pg.abort()
        sent = self.last_bytes = flat.numel() * flat.element_size()
        self.metrics.network_bytes_total.labels(direction="sent").inc(sent)
        self.metrics.network_bytes_total.labels(direction="received").inc(sent)
        offset = 0
        for p, local in zip(params, locals_):
            part = flat[offset:offset + local.numel()].view_as(local)
            if p.grad is None:
                p.grad = (DTensor.from_local(part.clone(), p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else part.clone())
            else:
                _local(p.grad).copy_(part)
            offset += local.numel()
        return flat[offset:].tolist()

    def commit(self) -> bool:
        """The group's vote on the step: True when it commits (the caller then steps its optimizer);
        a discarded step is counted, and written to the event log with its error."""
        error = self.manager.errored()
        if error is None and self._holding():
            # Every rank of the group votes no (torchft's protocol runs as for a discarded step): the
            # step is trained again under the next quorum. Not a discard: no event, no count.
            self.manager.report_error(RuntimeError(f"{FT_HOLD_VAR}: step {self.step + 1} held"))
            self.manager.should_commit()
            time.sleep(HOLD_POLL_SECONDS)
            return False
        committed = self.manager.should_commit()  # applies a peer's state first when this group heals
        now = time.time()
        if not committed:
            self._discarded_since_commit += 1
            self.metrics.ft_discarded_steps_total.inc()
            why = self._error(error) or "fewer than minReplicas replica groups took part"
            self.last_error = why
            self.events.write("discard", step=self.step + 1, participants=self.participants, error=why)
            log.warning("%s: step %d discarded: %s", self.ctx.replica, self.step + 1, why)
            return False
        self.metrics.ft_committed_steps_total.inc()
        self.held_step = self.step
        if self.participants != self._participants_at_commit:
            # The first step committed under another quorum: how long the group stood since its last one.
            stalled = now - self._last_commit if self._last_commit is not None else None
            self.events.write("quorum", step=self.step, participants=self.participants,
                              previous=self._participants_at_commit, discarded=self._discarded_since_commit,
                              last_commit_time=self._last_commit, stall_seconds=stalled)
            log.info("%s: step %d committed by %s replica groups (were %s)", self.ctx.replica, self.step,
                     self.participants, self._participants_at_commit)
            self._participants_at_commit = self.participants
        self._last_commit = now
        self._discarded_since_commit = 0
        return True

    def _holding(self) -> bool:
        """Whether the step about to commit is held (`Hold`): too few groups in its quorum, and not yet held
        for quorumTimeoutSeconds. Writes a `hold` event when it starts."""
        hold = self.hold
        if hold is None or self.step + 1 != hold.step or (self.participants or 0) >= hold.groups:
            return False
        now = time.monotonic()
        if self._hold_since is None:
            self._hold_since = now
            self.events.write("hold", step=hold.step, participants=self.participants, groups=hold.groups)
            log.info("%s: step %d held until %d replica groups take part (%s)", self.ctx.replica, hold.step,
                     hold.groups, FT_HOLD_VAR)
        if now - self._hold_since <= self.spec.quorum_timeout_seconds:
            return True
        log.warning("%s: step %d held for %.0f s (quorumTimeoutSeconds) with %s of %d replica groups; "
                    "committed with those", self.ctx.replica, hold.step, now - self._hold_since,
                    self.participants, hold.groups)
        self.hold = None
        return False

    def agree(self, flag: bool) -> bool:
        """Whether any rank of this group says so (a SIGTERM seen by one of them): the group's ranks only."""
        if self.place.local_world == 1:
            return flag
        box = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item() > 0)

    # --- state ---------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """What this group's checkpoint holds: the owner's state and the Manager's step counters."""
        return {**self._state(), "torchft": self.manager.state_dict()}

    def _for_peer(self) -> dict[str, Any]:
        # A sharded model's DTensors as this rank's shards: the healing group's rank of the same place takes them.
        return {**fsdp.to_local(self._state()), "group": self.place.group}

    @property
    def pending_heal(self) -> bool:
        """A quorum found this group behind, and the peer's state is not applied yet (it is at the next commit)."""
        return self.manager.current_step() > self.held_step

    def _from_peer(self, state: dict[str, Any]) -> None:
        """A heal: a live group's state, applied at this step's commit (torchft calls it there)."""
        self._load(state)
        self.held_step = self.manager.current_step()
        seconds = time.monotonic() - self._heal_started if self._heal_started is not None else float("nan")
        self.metrics.ft_heals_total.inc()
        if math.isfinite(seconds):
            self.metrics.ft_heal_duration_seconds.observe(seconds)
        self.events.write("heal", step=self.step, source=rank_replica(int(state.get("group", -1)) * self.place.local_world
                                                                      + self.place.local_rank),
                          source_group=state.get("group"), seconds=seconds)
        log.info("%s: healed from replica group %s at step %d in %.2f s (no checkpoint read)", self.ctx.replica,
                 state.get("group"), self.step, seconds)

    def _error(self, error: Any = None) -> str:
        error = error if error is not None else self.manager.errored()
        if error is None:
            return ""
        original = getattr(error, "original_exception", error)
        return f"{type(original).__name__}: {first_line(original)}"[:ERROR_CHARS]

    def close(self) -> None:
        if self.manager is not None:
            with contextlib.suppress(Exception):  # a Manager that never joined has nothing to stop
                self.manager.shutdown(wait=False)


class FaultTolerantTrainer(DDPTrainer):
    """The built-in loop in one rank of a replica group: DDPTrainer's model, data, metrics, checkpoints
    and evaluation, with the group's step (`ReplicaGroup`) in place of DDP's.

    The data follows the quorum (`QuorumCursor`, one cursor in every group, committed with the model):
    each step the ranks of the groups that train share its global batch, `batchSize` samples each, and a
    discarded step's samples are dealt again. Every sample of an epoch is trained exactly once, whatever the
    faults: an epoch takes more steps while fewer groups train. With spare groups (`spareGroups`) the first
    ddp.nodes groups of the quorum (by group index) train; the others take part in every average with
    nothing of their own, so they hold the same model and optimizer and train at once when a group is lost.
    With every group there and no spare, the batches and averaged gradients are plain DDP's."""

    # The quorum's cursor, in the place TrainState keeps a ShardCursor (the same state_dict interface).
    cursor: QuorumCursor  # type: ignore[assignment]

    reads_checkpoint_at_start = False  # the first quorum decides: heal from a peer, or restore (ReplicaGroup.join)

    def __init__(self, ctx: ReplicaContext, topo: Topology):
        self.place = GroupPlace.from_env(os.environ)
        super().__init__(ctx, topo)
        self.group: ReplicaGroup | None = None
        self.lanes = 0
        """Ranks that trained the last step (the training groups x procsPerNode)."""
        self.tally = torch.zeros(len(self.train_x), dtype=torch.int32) if counts_samples(os.environ) else None
        """KUBETRAIN_TEST_FT_COUNT (testhooks.counts_samples): how often the committed steps of the epoch in progress trained each sample."""

    def placement(self, topo: Topology, spec: Any) -> tuple[int, int]:
        if topo.world_size != spec.ddp.procs_per_node:
            raise ConfigError(f"spec.ddp.procsPerNode: a replica group has {spec.ddp.procs_per_node} ranks, "
                              f"but torchrun started {topo.world_size}")
        return self.place.rank, self.place.ranks

    def make_cursor(self) -> QuorumCursor:
        training = self.ctx.spec.require_training()
        return self.data.quorum_cursor(training.batch_size, training.seed,
                                       nominal=self.ctx.spec.require_ddp().nodes * self.place.local_world)

    def writes_checkpoints(self) -> bool:
        return self.topo.local_rank == 0  # every group writes its own, for the loss of every group

    def join(self) -> None:
        spec = self.ctx.spec
        if self.place.local_world > 1 or self.fsdp:
            dist.init_process_group(spec.require_ddp().backend,
                                    timeout=timedelta(seconds=spec.run_policy.progress_deadline_seconds))
        if self.fsdp:
            # HSDP: the model sharded over the group's own ranks, replicated across the groups (before the
            # first quorum: a heal or a restore loads into the shards).
            fsdp.shard(self.model, self.device, self.place.local_world)
            if not getattr(self.model, "materialized", True):
                self.model.materialize(self.device)  # type: ignore[operator]
            self.optimizer = build_optimizer(self.model.parameters(), spec.require_training().optimizer)
        self.group = ReplicaGroup(self.ctx, self.place, self.metrics, self.events, self.checkpoints,
                                  state=self.state, load=self.load, device=self.device)
        self.step = self.group.join()
        startup("joined", rank=self.rank, step=self.step)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def load(self, state: dict[str, Any]) -> None:
        """A checkpoint's or a healing peer's state, the cursor with it (HSDP: this rank's shards, as DTensors
        from a checkpoint or as local tensors from a peer's rank of the same place)."""
        if self.fsdp:
            model_sd, optim_sd = fsdp.from_local(self.model, state["model"], state["optimizer"])
            fsdp.load_model_state(self.model, self.optimizer, model_sd, optim_sd)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_cursor(state["cursor"], state.get("step"))
        self.samples = state["samples"]
        self.loss = state["loss"]
        self.bytes_sent = state["bytes_sent"]
        self.raw_gradient_bytes = state["raw_gradient_bytes"]
        if self.tally is not None and "tally" in state:
            self.tally = state["tally"].clone()

    def load_cursor(self, saved: Any, step: Any = None) -> None:
        if isinstance(saved, str):  # a sharded checkpoint's (DDPTrainer.weights_state)
            saved = json.loads(saved)
        if saved is None and isinstance(step, int) and not isinstance(step, bool):
            # A checkpoint of kubetrain 2026-12-04, before the data followed the quorum: its place was a function
            # of the step, and so is the migrated cursor's (QuorumCursor.seek; tests/local/test_golden_checkpoints.py).
            log.warning("%s: the checkpoint of step %d holds no data cursor (written before the data followed the "
                        "quorum): resumed at that step's place in the epoch", self.ctx.replica, step)
            self.cursor.seek(step)
            return
        if not isinstance(saved, Mapping):
            raise ConfigError("the checkpoint holds no data cursor, and no step to place one at: not a checkpoint of "
                              "a fault-tolerant job")
        self.cursor.load_state_dict(saved)

    def state(self) -> dict[str, Any]:
        out = super().state()
        del out["rng"]  # the built-in models draw no random numbers while training
        if self.tally is not None:
            out["tally"] = self.tally
        return out

    def checkpoint(self) -> None:
        assert self.group is not None
        # HSDP: every rank writes its own shards (into its group's directory); else the group's first rank.
        wanted = self.checkpoints.writer or self.fsdp
        self.checkpoints.save(self.step, self.group.checkpoint_state() if wanted else {})
        self.checkpoint_step = self.step

    def wait_checkpoint(self) -> None:
        self.checkpoints.wait()

    def end(self) -> tuple[int, int]:
        """Where the cursor ends training (the nominal ranks are the committed cursor's: a heal may set them)."""
        training = self.ctx.spec.require_training()
        return self.cursor.end(training.max_steps, training.effective_epochs)

    def train_share(self, block: Block, lane: int, participants: int) -> float:
        """Forward and backward on this rank's share of `block`, weighted so that the average over every rank
        of the quorum's groups is the mean over the block's samples (`scale_share`); a rank with no share
        leaves zeros. Returns its mean loss.

        HSDP (a sharded model): the weight scales the loss, before FSDP's reduce-scatter averages the group's
        ranks; a rank of a training group with no sample (a short last block) runs a sample of weight 0, for
        its group's collectives."""
        assert self.group is not None
        indices = self.cursor.share(block, lane).to(self.device)
        if self.fsdp:
            if lane < 0:
                self.model.zero_grad(set_to_none=True)  # the whole group trains nothing: no collective
                return 0.0
            weight = len(indices) * participants * self.place.local_world / block.size
            if not len(indices):
                indices = self.cursor.share(block, 0)[:1].to(self.device)
            loss = compute_gradients(self.model, self.train_x[indices], self.train_y[indices], self.data.objective,
                                     self.recipe, scale=weight)
            return loss if weight else 0.0
        if not len(indices):
            self.model.zero_grad(set_to_none=True)
            return 0.0
        loss = compute_gradients(self.model, self.train_x[indices], self.train_y[indices], self.data.objective,
                                 self.recipe)
        self.group.scale_share(list(self.model.parameters()), len(indices), block, participants)
        return loss

    def weights_digest(self) -> float:
        """The sum of the squares of every weight, over the group's shards: equal in groups that hold the same
        model (a test's check, in the results)."""
        total = torch.zeros(1, dtype=torch.float64)
        for p in self.model.parameters():
            total += _local(p.detach()).double().pow(2).sum().cpu()
        if self.fsdp and self.place.local_world > 1:
            dist.all_reduce(total)
        return float(total.item())

    def run(self) -> int:
        self.metrics.process_starts_total.inc()
        port = self.ctx.metrics_port
        self.metrics.serve(port + self.topo.local_rank if port else 0, self.ctx.listen_address)
        spec = self.ctx.spec
        # Before joining: what the first quorum decides (a `resume` from this group's checkpoint, or a
        # `heal` from a peer) is written after the attempt's `start`.
        self.events.write(
            "start", step=self.step, total_steps=self.total_steps, device=str(self.device), threads=self.threads,
            rank=self.rank, world_size=self.world_size, node=self.place.group, pid=os.getpid(),
            node_replica=self.node_replica, replica_group=self.place.group, replica_groups=self.place.groups,
            backend=spec.require_ddp().backend, fault_tolerant=True,
        )
        self.join()
        group = self.group
        assert group is not None
        if self.evaluates_baseline():  # a causal-lm's pretrained model, before any step (after a resume: none)
            self.evaluate()
        params = list(self.model.parameters())
        run_samples, train_seconds = 0, 0.0
        self.reporter.start_window(self.step)
        while not self.cursor.done(self.end()):
            step_start = time.perf_counter()
            group.begin()
            self.slowdown.begin()
            lane, lanes, participants = group.deal()
            block = self.cursor.next_block(lanes, self.end())
            if lanes != self.lanes:
                self.cursor.hint(max(lane, 0), lanes)  # sharded data: fetch ahead what this rank trains now
            for param_group in self.optimizer.param_groups:
                # plain DDP's schedule: its step and its steps (the progress's total counts this job's own)
                param_group["lr"] = self.recipe.rate(self.cursor.nominal_step,
                                                     planned_steps(spec.require_training(), self.cursor.steps_per_epoch))
            local_loss = self.train_share(block, lane, participants)
            trained = block.count(lane)
            self.slowdown.after()
            counted = self.counted(block, lane)
            values = group.average(params, [local_loss * trained, float(trained), *counted])
            self.bytes_sent += group.last_bytes
            committed = group.commit()
            self.step = group.step
            if committed:
                # A group that healed in this step holds its peers' cursor now: the block they trained.
                block = self.cursor.next_block(lanes, self.end())
                epoch_ended = self.cursor.advance(block)
                if self.recipe.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                                   self.recipe.max_grad_norm)
                optimizer_step(self.optimizer)
                startup("first_step", rank=self.rank, step=self.step)
                self.loss = values[0] / values[1] if values[1] else local_loss
                self.samples += trained
                run_samples += trained
                now = time.perf_counter()
                train_seconds += now - step_start
                self.metrics.step_duration_seconds.observe(now - step_start)
                if lanes != self.lanes:
                    self.replan(lanes)
                if self.cursor.done(self.end()):
                    self.reporter.set_total(self.step)  # the last step: its event is written, the total exact
                self.reporter.report(self.step, samples=trained, loss=self.loss, event_fields={
                    "local_loss": local_loss, "samples": self.samples, "epoch": round(self.cursor.epochs_done, 4),
                    # What the step trained, for the count of every sample once: the block of the epoch's
                    # order, its ranks, this rank's lane among them and its share.
                    "block": [block.epoch, block.start, block.size], "lanes": lanes, "lane": lane,
                    "trained": trained, "participants": participants, "job_samples": self.cursor.trained})
                if self.tally is not None:
                    self.count(values[2:], participants, block.epoch if epoch_ended else None)
                if epoch_ended:
                    self.evaluate()
                if self.step % spec.checkpoint.interval_steps == 0 or self.cursor.done(self.end()):
                    self.checkpoint()
            if group.agree(self.ctx.stop_requested) and not self.cursor.done(self.end()):
                self.checkpoint()
                self.wait_checkpoint()
                self.events.write("stop", step=self.step)
                log.info("%s: stopped by SIGTERM at step %d, checkpoint written", self.ctx.replica, self.step)
                return EXIT_TERMINATED
        if group.pending_heal:
            # Joined as the others finished (a StatefulSet restarts a container that ended 0 too): a live
            # group's state was promised at the job's last step, but no step is left to apply it at. This
            # group holds nothing to checkpoint or report; the groups that trained have.
            log.info("%s: the job's groups finished at step %d; nothing left to train", self.ctx.replica, self.step)
            self.events.write("end", step=self.step, wall_seconds=time.monotonic() - self.started, trained=False)
            return EXIT_OK
        # The first rank of every group evaluates the final model (a group's result speaks for the job
        # when the chief's group was replaced: engine._final_progress, local summary). Only the chief
        # evaluated at the epochs' ends (the others only marked the step): the others evaluate now, every
        # rank of the group together (a sharded model's forward gathers its layers from all of them).
        if self.place.group != 0:
            self.chief, self.eval_step = self.topo.local_rank == 0, -1
        wall = self.final_checkpoint()
        result: dict[str, Any] = {
            **self.result(wall, run_samples, train_seconds),
            "rank": self.rank,
            "world_size": self.world_size,
            "replica_group": self.place.group,
            "weights_digest": self.weights_digest(),
        }
        if self.chief:
            result.update(**self.eval_results())
        if self.checkpoints.writer:
            result.update(checkpoint_step=self.checkpoint_step, checkpoint_time=time.time())
        # Every group's first rank speaks in its own pod's termination message.
        write_result(self.ctx.run_dir, self.ctx.replica, result,
                     termination_log=self.ctx.termination_log if self.topo.local_rank == 0 else None)
        self.events.write("end", step=self.step, wall_seconds=wall)
        return EXIT_OK

    def counted(self, block: Block, lane: int) -> list[float]:
        """KUBETRAIN_TEST_FT_COUNT: one value per training sample, 1 for those this rank trains in the step."""
        if self.tally is None:
            return []
        mine = torch.zeros(len(self.tally))
        mine[self.cursor.share(block, lane)] = 1.0
        return mine.tolist()

    def count(self, averaged: list[float], participants: int, ended: int | None) -> None:
        """Add a committed step's samples (the average of every rank's `counted`) to the tally; at an epoch's
        end, write how many were trained never, once and more often, and begin the next epoch's."""
        assert self.tally is not None
        ranks = participants * self.place.local_world
        self.tally += torch.tensor(averaged).mul(ranks).round().to(torch.int32)
        if ended is None:
            return
        if self.topo.local_rank == 0:
            self.events.write("epoch_samples", step=self.step, epoch=ended, never=int((self.tally == 0).sum()),
                              once=int((self.tally == 1).sum()), more=int((self.tally > 1).sum()))
        self.tally.zero_()

    def replan(self, lanes: int) -> None:
        """The ranks that train changed: the steps left at this width, for the progress (the status's total)."""
        self.lanes = lanes
        self.total_steps = self.step + self.cursor.steps_left(self.end(), lanes)
        self.reporter.set_total(self.total_steps)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def run_replica_group(ctx: ReplicaContext) -> int:
    """Train as one rank of a fault-tolerant replica group; returns the exit code.

    0 when the job is done, 143 after a SIGTERM (checkpoint written), 2 for a configuration that
    cannot work, 75 when no quorum formed within quorumTimeoutSeconds, 1 for any other failure. A
    discarded step is none of these: the loop goes on. torchrun restarts nothing (--max-restarts 0):
    the node ends, and the job's restart policy replaces it alone.
    """
    trainer = FaultTolerantTrainer(ctx, Topology.from_env(os.environ))
    failure = ""
    try:
        return trainer.run()
    except TrainerError:
        raise
    except Exception as err:  # noqa: BLE001 - logged in full, reported as one line
        log.error("%s: training failed:\n%s", trainer.ctx.replica, "".join(traceback.format_exception(err)))
        failure = f"{type(err).__name__}: {first_line(err)}"
    finally:
        trainer.close()
    raise TrainerError(f"{trainer.ctx.replica}: training failed: {failure}")


class FaultTolerance:
    """A user's model and optimizer in a fault-tolerant replica group: `kubetrain.fault_tolerant`.

    The same `ReplicaGroup` as the built-in loop, with the script's `import kubetrain` session (its
    metrics, event log and checkpoints): a step that cannot complete is discarded, never raised; a
    replacement heals from a live group without reading a checkpoint; the loss of every group
    falls back to each group's own newest checkpoint (`save`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: Callable[[], dict[str, Any]] | None = None,
                 load_state: Callable[[dict[str, Any]], None] | None = None,
                 samples: int | None = None, batch_size: int | None = None, epochs: int | None = None,
                 max_steps: int | None = None, seed: int = 0):
        from ..userapi import check_state, session

        self.session = session()
        ctx = self.session.ctx
        if not ctx.spec.fault_tolerant:
            raise RuntimeError("kubetrain.fault_tolerant: the job has no spec.ddp.faultTolerance; without it a "
                               "DDP script averages its gradients with torch's DistributedDataParallel")
        place = GroupPlace.from_env(os.environ)
        if place.local_world > 1 and not dist.is_initialized():
            dist.init_process_group(ctx.spec.require_ddp().backend)  # the group's own ranks (torchrun's environment)
        self.model, self.optimizer = model, optimizer
        self._user_state, self._user_load, self._check = state, load_state, check_state
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("kubetrain.fault_tolerant: the model has no parameter that requires a gradient")
        self.loss = float("nan")
        """The loss of the last committed step, averaged over the groups that took part (as passed to commit)."""
        self.cursor: QuorumCursor | None = None
        self._end = (0, 0)
        self._dealt: tuple[Block, int, int, int] | None = None  # the step's (block, lane, lanes, groups taking part)
        if samples is not None or batch_size is not None or epochs is not None or max_steps is not None:
            if (epochs is None) == (max_steps is None):
                raise ValueError("kubetrain.fault_tolerant: pass one of epochs, max_steps with samples and batch_size, "
                                 f"got epochs={epochs!r}, max_steps={max_steps!r}")
            for name, value in (("samples", samples), ("batch_size", batch_size), ("epochs", epochs or max_steps)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    name = name if name != "epochs" or epochs is not None else "max_steps"
                    raise ValueError(f"kubetrain.fault_tolerant: {name} must be a positive integer (the data is dealt "
                                     f"by each step's quorum with samples, batch_size and epochs or max_steps), "
                                     f"got {value!r}")
            assert samples is not None and batch_size is not None
            try:
                self.cursor = QuorumCursor(samples, batch_size, seed, nominal=ctx.spec.require_ddp().nodes * place.local_world)
            except ConfigError as err:
                raise ValueError(f"kubetrain.fault_tolerant: {err}") from None
            self._end = self.cursor.end(max_steps, epochs)
        self.group = ReplicaGroup(ctx, place, self.session.metrics, self.session.events, self.session.checkpoints,
                                  state=self._state, load=self._load, device=self.params[0].device)
        self.group.join()
        self.session.reporter.start_window(self.step)

    @property
    def step(self) -> int:
        """Steps the job has committed: the next one trains the batch of this step (a replacement's is
        its peers', once it healed)."""
        return self.group.step

    @property
    def participants(self) -> int | None:
        """Replica groups in the last step's quorum."""
        return self.group.participants

    @property
    def done(self) -> bool:
        """Whether the job's committed steps trained every epoch (with `samples`, `batch_size`, `epochs`)."""
        return self._data().done(self._end)

    @property
    def epoch(self) -> int:
        """The epoch the next step trains (with `samples`, `batch_size`, `epochs`)."""
        return self._data().epoch

    def _data(self) -> QuorumCursor:
        if self.cursor is None:
            raise RuntimeError("kubetrain.fault_tolerant: pass samples, batch_size and epochs to have the data dealt "
                               "by each step's quorum (indices(), done, epoch)")
        return self.cursor

    def zero_grad(self) -> None:
        """Start the step: its quorum (in the background) and the gradients set to none."""
        self.group.begin()
        self.optimizer.zero_grad(set_to_none=True)

    def indices(self) -> torch.Tensor:
        """After `zero_grad`: this rank's samples of the step (positions 0 .. samples - 1 of your dataset),
        dealt among the ranks of the groups that train it (it waits for the step's quorum). Empty for a spare
        group, a group healing in this step, or a rank past a short last batch: then leave the gradients
        unset and commit. A discarded step's samples are dealt again; every sample of an epoch is trained
        exactly once, whatever the faults."""
        cursor = self._data()
        lane, lanes, participants = self.group.deal()
        block = cursor.next_block(lanes, self._end)
        self._dealt = (block, lane, lanes, participants)
        return cursor.share(block, lane)

    def commit(self, loss: Any = None) -> bool:
        """After the backward pass: average the gradients (and `loss`) over the group's ranks and the
        quorum's groups, vote, and step the optimizer when the step commits. False: the step was
        discarded (a group was lost in it, or fewer than minReplicas took part): train the same step again."""
        value = float(loss.item() if hasattr(loss, "item") else loss) if loss is not None else float("nan")
        dealt, self._dealt = self._dealt, None
        if dealt is not None:  # the step's samples came from indices(): the mean over the step's whole batch
            block, lane, lanes, participants = dealt
            trained = block.count(lane)
            self.group.scale_share(self.params, trained, block, participants)
            values = self.group.average(self.params, [value * trained if trained else 0.0, float(trained)])
        else:
            values = self.group.average(self.params, [value, 1.0])
        if not self.group.commit():
            return False
        if dealt is not None and self.cursor is not None:
            self.cursor.advance(self.cursor.next_block(dealt[2], self._end))  # after a heal: the peers' cursor
        self.optimizer.step()
        self.loss = values[0] / values[1] if values[1] else value
        return True

    def save(self, wait: bool = False) -> None:
        """This group's checkpoint of the current step (the model, the optimizer, your `state()`), written by
        its first rank in the background: what the job resumes from when every group is lost."""
        state = self.group.checkpoint_state()
        self._check(state)
        self.session.checkpoints.save(self.step, state)
        if wait:
            self.session.checkpoints.wait()

    def _state(self) -> dict[str, Any]:
        out = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.cursor is not None:
            out["cursor"] = self.cursor.state_dict()
        if self._user_state is not None:
            out["user"] = self._user_state()
        return out

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.cursor is not None:
            if "cursor" not in state:
                raise ConfigError("kubetrain.fault_tolerant: the state (a checkpoint, or a peer's) holds no data cursor: "
                                  "pass samples, batch_size and epochs in every group, or start the job afresh")
            self.cursor.load_state_dict(state["cursor"])
        if self._user_load is not None and "user" in state:
            self._user_load(state["user"])
