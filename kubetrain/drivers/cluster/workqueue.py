"""A work queue of jobs that changed, for a bounded pool of reconcile workers (as client-go's).

- A key (a job) is in the queue at most once however often it is added: ten pod
  events in a burst are one reconciliation.
- A key being processed is never handed to a second worker; added meanwhile, it
  is queued again once the first worker is done, so no change is lost.
- `add_after` delays a key (a backoff, the next look at a running job); an
  earlier time wins over a later one.
- `backoff` is the per-key exponential delay after errors (`forget` resets it).

The queue holds at most one entry per job, so its size is bounded by the number
of jobs the operator watches; the worker count bounds the concurrency.

Two lanes. A key added `urgent` (a job one of whose pods died or went: a
replacement to make) is handed out before every routine key (a status to
follow, a creation burst's next job), so a lost pod is not replaced behind a
thousand jobs that have just started; an urgent add of a key already waiting in
the routine lane moves it. Routine keys are not starved: after URGENT_STREAK
urgent keys in a row while routine ones wait, one routine key goes. A worker may
take urgent keys only (`get(urgent_only=True)`): the operator keeps one such, so
that a replacement never waits for a worker busy with a long routine round.

Urgent work also goes first at the API server and for the interpreter: while an urgent key waits or is
being processed, the routine rounds' requests wait for it (`wait_urgent_clear`, up to
kube.ROUTINE_YIELD_SECONDS each).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Hashable

ERROR_BACKOFF_BASE_SECONDS = 0.5
ERROR_BACKOFF_CAP_SECONDS = 60.0
URGENT_STREAK = 20
"""Urgent keys handed out in a row while routine keys wait, before one routine key goes: a storm of
failures (a node lost with hundreds of pods) still lets other jobs' rounds through, at 1 in 21."""


class WorkQueue:
    def __init__(self, clock=time.monotonic, on_wait=None):
        """`on_wait(lane, seconds)`: told, as each key is handed out, how long it waited ready in its lane."""
        self._clock = clock
        self._on_wait = on_wait
        self._cond = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._urgent: deque[Hashable] = deque()
        self._dirty: set[Hashable] = set()  # queued, or to queue again once processed
        self._dirty_urgent: set[Hashable] = set()  # of those, the urgent ones
        self._since: dict[Hashable, float] = {}  # when each queued key became ready
        self._streak = 0
        self._processing: set[Hashable] = set()
        self._urgent_busy: set[Hashable] = set()  # of those, the ones handed out from the urgent lane
        self._delayed: list[tuple[float, int, Hashable]] = []  # (due, seq, key)
        self._due: dict[Hashable, float] = {}  # each key's earliest pending due time
        self._seq = 0
        self._failures: dict[Hashable, int] = {}
        self._closed = False

    def add(self, key: Hashable, urgent: bool = False) -> None:
        with self._cond:
            self._add(key, urgent)

    def _add(self, key: Hashable, urgent: bool = False) -> None:
        if self._closed:
            return
        if key in self._dirty:
            if urgent and key not in self._dirty_urgent:  # waiting routine: move it up
                self._dirty_urgent.add(key)
                if key not in self._processing:
                    self._queue.remove(key)  # O(queue length), only on this rare move
                    self._urgent.append(key)
                    self._cond.notify_all()
            return
        self._dirty.add(key)
        if urgent:
            self._dirty_urgent.add(key)
        if key not in self._processing:
            self._since[key] = self._clock()
            (self._urgent if urgent else self._queue).append(key)
            self._cond.notify_all()  # an urgent-only worker may be among the waiters

    def add_after(self, key: Hashable, seconds: float) -> None:
        if seconds <= 0:
            self.add(key)
            return
        with self._cond:
            due = self._clock() + seconds
            if self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            self._seq += 1
            heapq.heappush(self._delayed, (due, self._seq, key))
            self._cond.notify()

    def get(self, timeout: float | None = None, urgent_only: bool = False) -> Hashable | None:
        """The next key to process (mark it done with `done`), urgent ones first; None when closed or on
        timeout. `urgent_only`: wait for an urgent key, leave routine ones to the other workers."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote()
                key, lane = self._next(urgent_only)
                if key is not None:
                    self._dirty.discard(key)
                    self._dirty_urgent.discard(key)
                    self._processing.add(key)
                    if lane == "urgent":
                        self._urgent_busy.add(key)
                    waited = self._clock() - self._since.pop(key, self._clock())
                    if self._on_wait is not None:
                        self._on_wait(lane, waited)
                    return key
                if self._closed:
                    return None
                wait = None if not self._delayed else max(0.0, self._delayed[0][0] - self._clock())
                if end is not None:
                    left = end - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def _next(self, urgent_only: bool) -> tuple[Hashable | None, str]:
        if self._urgent and (urgent_only or not self._queue or self._streak < URGENT_STREAK):
            self._streak = self._streak + 1 if self._queue else 0
            return self._urgent.popleft(), "urgent"
        if self._queue and not urgent_only:
            self._streak = 0
            return self._queue.popleft(), "routine"
        return None, ""

    def depth(self) -> dict[str, int]:
        """Keys ready and waiting for a worker, by lane (delayed ones not counted)."""
        with self._cond:
            return {"urgent": len(self._urgent), "routine": len(self._queue)}

    def _promote(self) -> None:
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due.get(key) == due:
                del self._due[key]
                self._add(key)

    def handed_urgent(self, key: Hashable) -> bool:
        """Whether `key`, being processed, was handed out from the urgent lane."""
        with self._cond:
            return key in self._urgent_busy

    def wait_urgent_clear(self, timeout: float) -> bool:
        """Wait until no urgent key is waiting or being processed, at most `timeout` seconds; whether it is
        clear. A routine round's request waits here, so that a replacement's requests find the API server
        and the interpreter free of the routine ones; bounded, so that a storm of urgent work (a node lost
        with hundreds of pods) slows routine rounds without stopping them."""
        end = self._clock() + timeout
        with self._cond:
            while (self._urgent or self._urgent_busy) and not self._closed:
                left = end - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._urgent_busy:
                self._urgent_busy.discard(key)
                self._cond.notify_all()
            if key in self._dirty:
                self._since[key] = self._clock()
                (self._urgent if key in self._dirty_urgent else self._queue).append(key)
                self._cond.notify_all()

    def backoff(self, key: Hashable) -> float:
        """Seconds to wait before retrying `key` after its n-th error in a row: 0.5 s, 1 s, 2 s, ... 60 s."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        return min(ERROR_BACKOFF_CAP_SECONDS, ERROR_BACKOFF_BASE_SECONDS * 2**n)

    def failures(self, key: Hashable) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def forget(self, key: Hashable) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def discard(self, key: Hashable) -> None:
        """A job that is gone: drop its delayed entries and error count (a queued entry finds no job)."""
        with self._cond:
            self._due.pop(key, None)
            self._failures.pop(key, None)

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._urgent) + len(self._due)

    def wait_closed(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True (at once) when the queue is closed: a periodic task's stop."""
        with self._cond:
            end = time.monotonic() + seconds
            while not self._closed and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
