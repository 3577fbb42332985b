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
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Hashable

ERROR_BACKOFF_BASE_SECONDS = 0.5
ERROR_BACKOFF_CAP_SECONDS = 60.0


class WorkQueue:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._dirty: set[Hashable] = set()  # queued, or to queue again once processed
        self._processing: set[Hashable] = set()
        self._delayed: list[tuple[float, int, Hashable]] = []  # (due, seq, key)
        self._due: dict[Hashable, float] = {}  # each key's earliest pending due time
        self._seq = 0
        self._failures: dict[Hashable, int] = {}
        self._closed = False

    def add(self, key: Hashable) -> None:
        with self._cond:
            self._add(key)

    def _add(self, key: Hashable) -> None:
        if self._closed or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cond.notify()

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

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key to process (mark it done with `done`); None when closed or on timeout."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote()
                if self._queue:
                    key = self._queue.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
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

    def _promote(self) -> None:
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due.get(key) == due:
                del self._due[key]
                self._add(key)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

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
            return len(self._queue) + len(self._due)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
