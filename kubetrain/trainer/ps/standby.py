"""Standby workers (spec.parameterServer.standbyWorkers): a worker's place, held or waited for at ps-0.

In a job with standby workers every worker process holds a `Stand` call open
to ps-0's coordinator for as long as it lives (coordinator.py): ps-0 learns of
a worker's death the moment its connection closes, and hands its place to a
standby waiting in a Stand call of its own. A standby
(`python -m kubetrain.trainer standby`) is a worker process without a place:
torch, gRPC and the model code imported, connected to ps-0, waiting. Handed a
place, it runs as that worker (`worker.run_worker`): it registers, gets the
place's cursor from ps-0 and trains on, a fraction of a second after the
death, where a new pod takes seconds (its start, the interpreter, torch's
import). A worker pod that finds its own place held (it replaces a worker a
standby took over) waits as the next standby.

`Place` keeps the call in a thread: a restarted ps-0 is asked again for the
same place (or, waiting, for any); a process told that its place went to
another while ps-0 was away stops (`lost`), and its pod's replacement waits as
a standby.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import random
import threading

import grpc

from ..context import ReplicaContext
from ..errors import TransientError
from ..events import startup
from . import ps_pb2 as pb
from . import ps_pb2_grpc
from .credentials import from_env as tls_from_env
from .transport import TOKEN_KEY, Backoff, call_with_retry, open_channel

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
"""How often a process waiting for its place looks at whether it was told to stop (SIGTERM)."""
CLOSE_SECONDS = 2.0
"""The longest `close` waits for the thread: it ends at its call's cancellation, or after one more try
of a call_with_retry under way (Backoff.cap, 0.5 s, and a dial)."""


class Place:
    """This process's Stand call to ps-0, kept open in a thread for as long as the process lives."""

    def __init__(self, ctx: ReplicaContext):
        self.ctx = ctx
        self.address = ctx.ps_addrs[0]
        self.incarnation = random.getrandbits(63) or 1
        self.channel = open_channel(self.address, tls_from_env())
        self.stub = ps_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = ((TOKEN_KEY, ctx.token),)
        self.backoff = Backoff(budget=float(ctx.spec.run_policy.progress_deadline_seconds),
                               give_up=lambda: ctx.stop_requested or self._closing)
        self.worker = -1
        """The place held (a worker index); -1 while none."""
        self.lost = threading.Event()
        """Set when the place was lost: another process holds it now, or ps-0 could not be reached again."""
        self.why_lost = ""
        self._events: queue.Queue[tuple[str, int]] = queue.Queue()
        self._closing = False
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None

    def take(self, worker: int) -> int | None:
        """Hold `worker`'s place, or (-1, or that place held by another process) wait for one.

        Returns the place held; None when the job's workers have all finished, SIGTERM came, or the Place
        was closed, first."""
        self._thread = threading.Thread(target=self._keep, args=(worker,), name="stand", daemon=True)
        self._thread.start()
        while True:
            try:
                what, place = self._events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self.ctx.stop_requested:
                    return None
                continue
            if what == "place":
                return place
            if what == "waiting":
                held = f"worker-{worker}'s place is held by another process" if worker >= 0 else "a standby"
                log.info("%s: %s; waiting for a worker's place at %s", self.ctx.replica, held, self.address)
                startup("standby")
            elif what == "done":
                log.info("%s: the job's workers have all finished; nothing to stand by for", self.ctx.replica)
                return None
            elif what == "closed":
                return None
            else:
                raise TransientError(f"{self.ctx.replica}: {self.why_lost}")

    def _keep(self, worker: int) -> None:
        """The thread: the Stand call, asked again whenever it breaks (ps-0 away), until closed."""
        ask = worker
        while not self._closing:
            try:
                call, first = call_with_retry(lambda: self._stand(ask), f"Stand at {self.address}", self.backoff)
            except grpc.RpcError as err:
                if not self._closing:
                    self._lose(f"Stand at {self.address} failed: {err.code().name}: {err.details()}")
                return
            try:
                for reply in itertools.chain([first], call):
                    if reply.done:
                        self._events.put(("done", -1))
                        return
                    if reply.worker >= 0:
                        self.worker = ask = reply.worker
                        self._events.put(("place", reply.worker))
                    elif self.worker >= 0:
                        self._lose(f"worker-{self.worker}'s place went to another process while ps-0 was away")
                        return
                    else:
                        ask = -1  # asked again after a break: for any place, not one another took meanwhile
                        self._events.put(("waiting", -1))
            except grpc.RpcError:
                continue  # ps-0 away (or this Place closed): stand again, with call_with_retry's backoff
            if not self._closing:
                self._lose("ps-0 ended the Stand call")
            return

    def _stand(self, ask: int) -> tuple[grpc.Future, pb.StandReply]:
        """One Stand call and its first reply (at once: the place, or -1)."""
        self._call = self.stub.Stand(pb.StandRequest(worker=ask, incarnation=self.incarnation),
                                     metadata=self.metadata)
        return self._call, next(self._call)

    def _lose(self, why: str) -> None:
        self.why_lost = why
        self.lost.set()
        self._events.put(("lost", -1))

    def close(self) -> None:
        """End the Stand call (its place, unless its worker finished, is handed over) and the thread."""
        self._closing = True
        self._events.put(("closed", -1))
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(CLOSE_SECONDS)  # the channel outlives the thread's last call
        self.channel.close()


def as_worker(ctx: ReplicaContext, worker: int) -> ReplicaContext:
    """The context of the place handed to this process: worker-`worker`, in this process's own directories
    (SIGTERM now sets its stop_requested)."""
    if ctx.role == "worker" and ctx.index == worker:
        return ctx
    placed = dataclasses.replace(ctx, replica=f"worker-{worker}", role="worker", index=worker)
    placed.install_signal_handlers()
    return placed
