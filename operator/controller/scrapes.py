"""The chiefs' /metrics, read by a pool of their own, never by the workers that reconcile jobs.

A chief is a tenant's code, and a scrape may take its whole deadline (kube.SCRAPE_SECONDS).
Scrapes used to run inside the reconcile workers: eight chiefs that stalled their answers
stalled the operator for every namespace. Now a round asks for a scrape and goes on with the
last result it has: at most SCRAPE_WORKERS scrapes run at once, at most one per job, each
job's at most every MIN_INTERVAL_SECONDS; a result that changes the job's progress queues the
job again (`on_change`), so the next round writes it.

A job a round asked about is followed: a ticker scrapes it again every INTERVAL_SECONDS on its own
(each job on its own clock, so the scrapes spread), so progress reaches the status without the
engine looking at every running job on a timer (at 1,000 running jobs that was 100 rounds a
second, a whole core, to find nothing new). A round that finds no chief to scrape, or a job that
ended, stops following it (`unfollow`).
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
"""The least time between the end of one scrape of a job and the start of the next, whoever asks."""
INTERVAL_SECONDS = 10.0
"""How often a followed job is scraped again on the ticker: the freshness of status.progress."""
TICK_SECONDS = 1.0
"""How often the ticker looks for followed jobs whose interval has passed."""


@dataclass
class _Entry:
    result: Any = None
    finished: float = float("-inf")
    running: bool = False
    read: Callable[[], Any] | None = None  # set while the job is followed


class Scrapes:
    """The latest scrape result of each job, and a bounded pool that refreshes them."""

    def __init__(self, on_change: Callable[[Hashable], None], workers: int = SCRAPE_WORKERS,
                 min_interval: float = MIN_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 interval: float = INTERVAL_SECONDS, tick: float | None = TICK_SECONDS):
        """`tick`: the ticker's period; None starts no ticker (tests call `tick()` themselves)."""
        self._on_change = on_change
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scrape")
        self._min_interval = min_interval
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._closed = threading.Event()
        if tick is not None:
            threading.Thread(target=self._ticker, args=(tick,), name="scrape-ticker", daemon=True).start()

    def latest(self, key: Hashable, read: Callable[[], Any]) -> Any:
        """The result of the job's latest finished scrape (None before the first); the job is followed
        with `read` from now on, and a scrape is started unless one is queued or running, or the last
        ended under MIN_INTERVAL_SECONDS ago. Never waits for a scrape."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.read = read  # the chief's address may have changed since the last round
            result = entry.result
            if entry.running or self._clock() - entry.finished < self._min_interval:
                return result
            entry.running = True
        self._pool.submit(self._run, key, entry, read)
        return result

    def unfollow(self, key: Hashable) -> None:
        """No more scrapes of the job on the ticker (no chief to read, or the job ended); its last
        result stays for the next round to see."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.read = None

    def tick(self) -> int:
        """Start a scrape of every followed job whose INTERVAL_SECONDS has passed; how many started."""
        due = []
        with self._lock:
            now = self._clock()
            for key, entry in self._entries.items():
                if entry.read is not None and not entry.running and now - entry.finished >= self._interval:
                    entry.running = True
                    due.append((key, entry, entry.read))
        for key, entry, read in due:
            self._pool.submit(self._run, key, entry, read)
        return len(due)

    def _ticker(self, period: float) -> None:
        while not self._closed.wait(period):
            try:
                self.tick()
            except RuntimeError:  # the pool shut down under it: the operator is stopping
                return

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
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
