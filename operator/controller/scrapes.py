"""The chiefs' /metrics, read by a pool of their own, never by the workers that reconcile jobs.

A chief is a tenant's code, and a scrape may take its whole deadline (kube.SCRAPE_SECONDS).
Scrapes used to run inside the reconcile workers: eight chiefs that stalled their answers
stalled the operator for every namespace. Now a round asks for a scrape and goes on with the
last result it has: at most SCRAPE_WORKERS scrapes run at once, at most one per job, each
job's at most every MIN_INTERVAL_SECONDS; a result that changes the job's progress queues the
job again (`on_change`), so the next round writes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SCRAPE_WORKERS = 4
"""Scrapes in flight at once. A trainer answers in milliseconds, so 4 read hundreds of jobs a
second; if every chief stalls to the deadline (2 s), 4 still read 2 jobs a second, and what waits
is progress in the status, never a reconcile. Past this, scrapes queue: at most one per job (a job
with one queued or running asks for none), so the queue is bounded by the jobs the operator watches."""
MIN_INTERVAL_SECONDS = 5.0
"""The least time between the end of one scrape of a job and the start of the next: the engine looks
at a running job every 10 s, and progress need not be fresher than that."""


@dataclass
class _Entry:
    result: Any = None
    finished: float = float("-inf")
    running: bool = False


class Scrapes:
    """The latest scrape result of each job, and a bounded pool that refreshes them."""

    def __init__(self, on_change: Callable[[Hashable], None], workers: int = SCRAPE_WORKERS,
                 min_interval: float = MIN_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic):
        self._on_change = on_change
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scrape")
        self._min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}

    def latest(self, key: Hashable, read: Callable[[], Any]) -> Any:
        """The result of the job's latest finished scrape (None before the first); a new scrape by
        `read` is started unless one is queued or running, or the last ended under
        MIN_INTERVAL_SECONDS ago. Never waits for a scrape."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            result = entry.result
            if entry.running or self._clock() - entry.finished < self._min_interval:
                return result
            entry.running = True
        self._pool.submit(self._run, key, entry, read)
        return result

    def _run(self, key: Hashable, entry: _Entry, read: Callable[[], Any]) -> None:
        try:
            result = read()
        except Exception:  # a bug must not leave the job marked running for ever
            log.exception("scrape of %s failed", key)
            result = None
        with self._lock:
            changed = result != entry.result
            entry.result, entry.finished, entry.running = result, self._clock(), False
            current = self._entries.get(key) is entry
        if changed and current:
            self._on_change(key)

    def forget(self, key: Hashable) -> None:
        """A job that is gone: its result is dropped (a scrape in flight ends unheard)."""
        with self._lock:
            self._entries.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
