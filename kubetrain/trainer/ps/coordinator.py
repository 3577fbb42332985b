"""The job's coordinator, hosted by ps-0: membership, ranks, each worker's data cursor, end of job.

A worker's rank is its index (worker-1 has rank 1), so a restarted worker
reads the same data shard. Its cursor (ShardCursor state) arrives with every
push to ps-0 and is checkpointed with ps-0's parameters: a restarted worker
continues from the last step ps-0 took from it, and a restarted ps-0 hands
out the cursors of its checkpoint. Workers stay stateless.

The membership: the set of workers of an elastic job, numbered. When the
job's size changes while it runs, ps-0's shard waits for a moment where no
worker holds a batch it has not pushed (server.py, the cut), then `resize`
deals what the workers left of the epoch again among the new set and numbers
it anew. Workers name their membership in every call; one of an older set
registers again and gets its new cursor, or is released (its index is past
the size) and leaves.

Standby workers (spec.parameterServer.standbyWorkers, standby.py): in such a
job every worker process holds a `Stand` call open to ps-0 for as long as it
lives, holding its place (its worker index). A process killed closes its
connection, so ps-0 learns of the death at once, long before the kubelet
does; the place, unless its worker had finished, goes to the earliest
standby waiting in a Stand call of its own: a process with torch imported
that registers as that worker and goes on from its cursor within a fraction
of a second. The dead worker's pod is replaced by the operator as always (its
restart counted, its backoff kept); finding its place held, the replacement
waits as the next standby. Never the chief's place (CHIEF).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from ..data import redeal
from . import ps_pb2 as pb
from . import ps_pb2_grpc

log = logging.getLogger(__name__)

# The most workers a job has (spec.parameterServer.workers, spec.replicas: the CRD's maximum). A Register
# from an index past the job's size but below this is answered `released`; beyond it, refused as invalid.
MAX_WORKERS = 1024
MEMBERSHIP_KEY = "membership"
CHIEF = 0
"""worker-0: it evaluates the final parameters, and its pod's results and progress speak for the job, so a
standby never takes its place (its pod is replaced as any)."""


@dataclass
class Member:
    incarnation: int = 0
    worker_step: int = 0
    last_contact: float = 0.0
    cursor_json: str = ""
    finished: bool = False


class Coordinator(ps_pb2_grpc.CoordinatorServicer):
    """Membership and cursors of the job's workers; thread-safe."""

    def __init__(self, workers: int, liveness_timeout: float, clock: Callable[[], float] = time.monotonic,
                 metrics: Any = None):
        self.workers = workers
        self.metrics = metrics
        """ps-0's TrainerMetrics: the standby workers waiting, the places handed over; None: not counted."""
        self.liveness_timeout = liveness_timeout
        self.clock = clock
        self.members = {w: Member(last_contact=clock()) for w in range(workers)}
        self.membership = 1
        """The number of the current set of workers; 1 at the job's start, one more at every resize."""
        self.lock = threading.Lock()
        # Standby workers (spec.parameterServer.standbyWorkers, `Stand`): every place (a worker index) held by
        # the incarnation of a live Stand call; the places whose holder's call ended before it finished; the
        # processes that wait for one, the earliest first.
        self.places: dict[int, int] = {}
        self.vacated: set[int] = set()
        self.waiting: list[int] = []
        self.changed = threading.Condition(self.lock)
        """Notified under the lock when a place is handed over, a Stand call ends or a worker finishes; the
        waiting Stand calls wait on it (at most the standbys and the replacements that found their place
        held), never the holders."""

    def _member(self, worker: int, context: grpc.ServicerContext) -> Member:
        if worker >= self.workers:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} is outside this job's {self.workers} workers (0..{self.workers - 1})",
            )
        return self.members[worker]

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        with self.lock:
            if self.workers <= request.worker < MAX_WORKERS:
                if not request.membership and request.worker < request.world_size and not self._ending():
                    # Started for a size the job file says and ps-0 has not taken yet: the resize comes (at
                    # the shard's next cut, within seconds of ps-0 reading the file), and then its cursor.
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"worker {request.worker}: the job has {self.workers} workers until the resize to "
                                  f"{request.world_size} is made; retry")
                # Past the job's size: a worker a resize left out, or one started for a size the job did not
                # take (asked as the job was ending). It leaves; nothing of the job is waiting for it.
                return pb.RegisterReply(rank=request.worker, world_size=self.workers, membership=self.membership,
                                        released=True)
            member = self._member(request.worker, context)
            member.incarnation = request.incarnation
            member.last_contact = self.clock()
            return pb.RegisterReply(
                rank=request.worker, world_size=self.workers, cursor_json=member.cursor_json, finished=member.finished,
                membership=self.membership,
            )

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with self.lock:
            member = self._member(request.worker, context)
            member.last_contact = self.clock()
            member.worker_step = max(member.worker_step, request.worker_step)
            return pb.HeartbeatReply(job_finished=all(m.finished for m in self.members.values()))

    def Stand(self, request: pb.StandRequest, context: grpc.ServicerContext) -> Iterator[pb.StandReply]:
        """Hold a place for as long as the calling process lives (module docstring, Standby workers).

        The first reply is the place (the worker index asked for, when no other live process holds it) or -1:
        the caller waits, and a second reply hands it a vacated place, or says the job is done. The call
        then stays open without further replies; its end (the process died, or finished) frees the place,
        and a place freed before its worker finished goes to the earliest waiting process at once."""
        me = request.incarnation
        if not me:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Stand: incarnation 0 (a process names itself by a "
                                                            "random non-zero number)")
        ended = threading.Event()

        def on_end() -> None:
            with self.lock:
                ended.set()
                self._leave(me)  # wakes the waiting calls, this one among them

        with self.lock:
            place = first = self._stand(request.worker, me)
        if not context.add_callback(on_end):
            on_end()  # the call ended already
            return
        yield pb.StandReply(worker=first)
        with self.lock:  # only a waiting call waits on `changed`: a holder waits for its own end alone
            while place < 0 and not ended.is_set():
                place = next((w for w, holder in self.places.items() if holder == me), -1)
                if place < 0 and self._all_finished():
                    break
                if place < 0:
                    self.changed.wait()
        if ended.is_set():
            return
        if place < 0:
            yield pb.StandReply(worker=-1, done=True)
            return
        if first < 0:
            yield pb.StandReply(worker=place)
        ended.wait()  # held: the call's end (on_end) frees the place

    def _stand(self, worker: int, me: int) -> int:
        """Under the lock: the place `me` holds from now on (its own, when free), else -1 and it waits."""
        if 0 <= worker < self.workers and self.places.get(worker, me) == me:
            self.places[worker] = me
            self.vacated.discard(worker)
            return worker
        if me not in self.waiting:
            self.waiting.append(me)
        self._hand_over()
        return -1

    def _leave(self, me: int) -> None:
        """Under the lock: the Stand call of `me` ended; a place it held before its worker finished is
        vacated (never the chief's, worker 0: its pod's results speak for the job) and handed over."""
        if me in self.waiting:
            self.waiting.remove(me)
        for worker in [w for w, holder in self.places.items() if holder == me]:
            del self.places[worker]
            member = self.members.get(worker)
            if worker != CHIEF and member is not None and not member.finished:
                self.vacated.add(worker)
        self._hand_over()

    def _hand_over(self) -> None:
        """Under the lock: vacated places to waiting processes, the earliest first; wakes every Stand call."""
        while self.waiting and self.vacated:
            worker = min(self.vacated)
            self.vacated.discard(worker)
            standby = self.waiting.pop(0)
            self.places[worker] = standby
            log.info("worker %d's process ended before it finished: a standby (incarnation %x) takes its place",
                     worker, standby)
            if self.metrics:
                self.metrics.ps_takeovers_total.inc()
        if self.metrics:
            self.metrics.ps_standby_workers.set(len(self.waiting))
        self.changed.notify_all()

    def _all_finished(self) -> bool:
        return all(m.finished for m in self.members.values())

    def record(self, worker: int, worker_step: int, cursor_json: str, finished: bool = False) -> None:
        """A worker's progress, as its push (or Finish) reached ps-0."""
        with self.lock:
            member = self.members[worker]
            member.last_contact = self.clock()
            member.worker_step = worker_step
            if cursor_json:
                member.cursor_json = cursor_json
            member.finished = member.finished or finished
            if finished:
                self._hand_over()  # the job may be done: waiting standbys leave

    def live(self) -> list[int]:
        """Workers heard from within the liveness timeout that have not finished."""
        now = self.clock()
        with self.lock:
            return [
                w for w, m in self.members.items()
                if not m.finished and now - m.last_contact < self.liveness_timeout
            ]

    def _ending(self) -> bool:
        """A member finished (under the lock): the job is ending, and takes no resize any more."""
        return any(m.finished for m in self.members.values())

    def resize(self, workers: int) -> int:
        """A new set of `workers` workers, live: what the members' cursors (as their last pushes left
        them) have not taken of the epoch is dealt again among the new set; returns its number. The
        caller (the shard's cut) makes sure no member holds a batch it has not pushed."""
        with self.lock:
            # Places above the new size are not handed over: their holders are released.
            self.vacated = {w for w in self.vacated if w < workers}
            cursors = {w: json.loads(m.cursor_json) for w, m in self.members.items() if m.cursor_json}
            old = self.workers
            self.workers = workers
            self.members = {w: Member(last_contact=self.clock()) for w in range(workers)}
            if cursors:
                self._redeal(cursors)
            self.membership += 1
            log.info("membership %d: %d workers (was %d)", self.membership, workers, old)
            return self.membership

    def state_dict(self) -> dict:
        with self.lock:
            members = {
                w: {"cursor_json": m.cursor_json, "worker_step": m.worker_step, "finished": m.finished}
                for w, m in self.members.items()
            }
            return {**members, MEMBERSHIP_KEY: self.membership}

    def load_state_dict(self, state: dict) -> bool:
        """Members and cursors from a checkpoint; True when the checkpoint was of another number of
        workers (an elastic job resized): then what its workers left of the epoch is dealt again among
        this job's workers (data.redeal), and every member starts afresh with its new cursor."""
        with self.lock:
            # Checkpoints from before live resizes have no membership: the job's first.
            self.membership = int(state.get(MEMBERSHIP_KEY, 1))
            saved = {int(w): m for w, m in state.items() if w != MEMBERSHIP_KEY}
            cursors = {w: json.loads(m["cursor_json"]) for w, m in saved.items() if m["cursor_json"]}
            worlds = {c["world_size"] for c in cursors.values()}
            if len(saved) == self.workers and worlds <= {self.workers}:
                for w, m in saved.items():
                    member = self.members[w]
                    member.cursor_json = m["cursor_json"]
                    member.worker_step = m["worker_step"]
                    member.finished = m["finished"]
                return False
            if cursors:
                self._redeal(cursors)
            # A new set: numbered past any a lost cut could have handed out (a cut is durable before
            # its workers hear of it, server.py), so every worker of the old one registers again.
            self.membership += 1
            return True

    def _redeal(self, cursors: dict[int, dict]) -> None:
        any_cursor = next(iter(cursors.values()))
        old_world = int(any_cursor["world_size"])
        # A worker that never pushed has its cursor's start: epoch 0, nothing taken.
        states = [cursors.get(w) or {**any_cursor, "epoch": 0, "position": 0, "rank": w, "plans": {}}
                  for w in range(old_world)]
        for w, cursor in enumerate(redeal(states, self.workers, equal=False)):
            self.members[w] = Member(last_contact=self.clock(), cursor_json=json.dumps(cursor))
        log.info("the job's workers went from %d to %d: the rest of epoch %d dealt again among them",
                 old_world, self.workers, min(s["epoch"] for s in states))
