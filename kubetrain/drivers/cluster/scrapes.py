"""The chiefs' /metrics, read by a pool of their own, never by the workers that reconcile jobs.

A chief is a tenant's code, and a scrape may take its whole deadline (kube.SCRAPE_SECONDS).
Scrapes used to run inside the reconcile workers: eight chiefs that stalled their answers
stalled the operator for every namespace. Now a round asks for a scrape and goes on with the
last result it has: at most SCRAPE_WORKERS reads run at once, at most one per job, each
job's at most every MIN_INTERVAL_SECONDS; a result that changes the job's progress queues the
job again (`on_change`), so the next round writes it.

A job a round asked about is followed: a ticker scrapes it again every INTERVAL_SECONDS on its own
(each job on its own clock, so the scrapes spread), so progress reaches the status without the
engine looking at every running job on a timer (at 1,000 running jobs that was 100 rounds a
second, a whole core, to find nothing new). A round that finds no chief to scrape, or a job that
ended, stops following it (`unfollow`).

What one job costs the pool is bounded, and never taken from the others (the tenants' third pass:
the deadline was per pod, so a fault-tolerant job of 1,024 nodes whose pods accept and never
answer held a worker for 1,024 x 2 s, about 34 minutes; four such jobs held the pool, every other
job's progress went stale, and the engine restarted them as Hung):

- one read of a job, however many of its pods it asks, ends within JOB_READ_SECONDS (`read_progress`);
- a job whose read took SLOW_READ_SECONDS or more is read in a lane of its own, SLOW_SCRAPE_WORKERS
  workers for every such job together, until it answers quickly again after SLOW_LANE_SECONDS: jobs
  that stall, however many, hold those workers and never the SCRAPE_WORKERS that read the others;
- a result older than STALE_SECONDS (the job's reads wait their turn) is given to the round as
  PROGRESS_UNKNOWN, never as the progress it once was: the engine does not take it for a job that
  stands still (engine.ProgressUnknown), and the read that ends the wait queues the job again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubetrain.engine.engine import PROGRESS_UNKNOWN, ProgressReading
from . import kube, observe

log = logging.getLogger(__name__)

SCRAPE_WORKERS = 4
"""Reads in flight at once for the jobs that answer (the main lane). A trainer answers in
milliseconds, so 4 read hundreds of jobs a second. Past this, reads queue: at most one per job (a job
with one queued or running asks for none), so the queue is bounded by the jobs the operator watches.
A job that stalls holds one of these for at most one read (JOB_READ_SECONDS), then moves to the slow
lane."""
SLOW_SCRAPE_WORKERS = 2
"""Reads in flight at once for the jobs whose last read was slow (SLOW_READ_SECONDS), all of them
together: if every one stalls to its deadline (4 s), 2 still read one such job every 2 s, each in its
turn (the lane's queue holds one read per job). What they hold is these workers, never the main lane's:
with a thousand stalling jobs the others' progress is read as often as with none."""
JOB_READ_SECONDS = 2 * kube.SCRAPE_SECONDS
"""One deadline over a whole read of a job, however many of its pods it asks (`read_progress`): a
ParameterServer job asks two (its chief, then ps-0), each within its own 2 s as before; a fault-tolerant
job asks its chief, then each other group in turn until one answers, and that is what the per-pod
deadline left unbounded (1,024 silent groups: 34 minutes). A read that runs out gives what it read."""
SLOW_READ_SECONDS = 1.0
"""A read that took this long or longer moves its job to the slow lane. A trainer answers in
milliseconds and a refused connection costs as little; a second is a loaded node's margin, and half
the scrape deadline: a chief that stalls to its deadline is slow by any count."""
SLOW_LANE_SECONDS = 300.0
"""A job moved to the slow lane leaves it only with a read under SLOW_READ_SECONDS that ends at
least this long after its last slow one. A chief that stalls for ever holds a main worker once, for
its first read; one that answers and stalls by turns holds one for at most one read (4 s) every 5
minutes, about 1.3 % of a worker, so it takes some 300 such jobs to hold the main lane."""
MIN_INTERVAL_SECONDS = 5.0
"""The least time between the end of one scrape of a job and the start of the next, whoever asks."""
INTERVAL_SECONDS = 10.0
"""How often a followed job is scraped again on the ticker: the freshness of status.progress."""
TICK_SECONDS = 1.0
"""How often the ticker looks for followed jobs whose interval has passed."""
STALE_SECONDS = 2 * INTERVAL_SECONDS
"""A result older than this is given to a round as PROGRESS_UNKNOWN. A followed job's result is at
most INTERVAL_SECONDS + TICK_SECONDS + JOB_READ_SECONDS (15 s) old while its reads run in time; older,
they wait behind other jobs' (in the slow lane, or a pool that cannot keep up), and what the result says
of the job's progress no longer holds: a stale step once was taken for a job that stood still."""


@dataclass
class _Entry:
    result: Any = None
    finished: float = float("-inf")
    running: bool = False
    read: Callable[[], Any] | None = None  # set while the job is followed
    slow_until: float | None = None  # in the slow lane (`slow_lane_until`); None: the main lane
    owed: bool = False  # a round was given PROGRESS_UNKNOWN: the next result queues the job, changed or not


def slow_lane_until(until: float | None, took: float, finished: float) -> float | None:
    """Whether a job is read in the slow lane after a read that took `took` seconds and ended at
    `finished`, its lane before that given by `until`: the time from which a quick read brings it back
    (None: the main lane, as it stays while its reads are quick)."""
    if took >= SLOW_READ_SECONDS:
        return finished + SLOW_LANE_SECONDS
    if until is not None and finished >= until:
        return None
    return until


def read_progress(ips: Mapping[str, str], port: int, heads: Sequence[str], shard: str | None,
                  seconds: float = JOB_READ_SECONDS) -> ProgressReading | None:
    """One read of a job's progress, every pod it asks within one deadline of `seconds`: its samples
    from the first of `heads` that answers (the chief; in a fault-tolerant job then each other group in
    turn, since any live group speaks for the job), and a ParameterServer job's `shard` (ps-0, which
    counts the global step). A pod not in `ips` (not running, outside --scrape-networks) is not asked.

    None when the pods it asked gave no step: they refused, answered without one, or stalled past their
    time (or the deadline ran out before every pod was asked). The engine's hang clock runs on then: the
    job's own pods did not answer, and a chief frozen with its port open (a deadlocked process accepts
    in the kernel, never answers) is a hang like any other. What is never taken for one is a result
    that is old because the job's reads waited behind other jobs' (`latest`: PROGRESS_UNKNOWN)."""
    deadline = time.monotonic() + seconds

    def samples(replica: str | None) -> dict[str, float] | None:
        if replica is None or replica not in ips:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        text = kube.scrape(ips[replica], port, timeout=min(kube.SCRAPE_SECONDS, left))
        return None if text is None else observe.parse_metrics(text)

    head = None
    for name in heads:  # the chief's group lost, the others train on: the first that answers speaks
        if time.monotonic() >= deadline:
            break  # the deadline ran out before this one was asked
        head = samples(name)
        if head:
            break
    shard_samples = samples(shard)
    return observe.progress_from(head or {}, shard_samples) if head or shard_samples else None


class Scrapes:
    """The latest scrape result of each job, and a bounded pool, in two lanes, that refreshes them."""

    def __init__(self, on_change: Callable[[Hashable], None], workers: int = SCRAPE_WORKERS,
                 min_interval: float = MIN_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 interval: float = INTERVAL_SECONDS, tick: float | None = TICK_SECONDS,
                 slow_workers: int = SLOW_SCRAPE_WORKERS, stale: float = STALE_SECONDS,
                 unknown: Any = PROGRESS_UNKNOWN):
        """`tick`: the ticker's period; None starts no ticker (tests call `tick()` themselves). `unknown`:
        what a round is given for a result older than `stale` (and for a read that raised)."""
        self._on_change = on_change
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scrape")
        self._slow = ThreadPoolExecutor(max_workers=slow_workers, thread_name_prefix="scrape-slow")
        self._min_interval = min_interval
        self._interval = interval
        self._stale = stale
        self._unknown = unknown
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._closed = threading.Event()
        if tick is not None:
            threading.Thread(target=self._ticker, args=(tick,), name="scrape-ticker", daemon=True).start()

    def latest(self, key: Hashable, read: Callable[[], Any]) -> Any:
        """The result of the job's latest finished scrape, or `unknown` when there is none yet or it is
        older than STALE_SECONDS (the next result then queues the job, changed or not); the job is
        followed with `read` from now on, and a scrape is started unless one is queued or running, or
        the last ended under MIN_INTERVAL_SECONDS ago. Never waits for a scrape."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.read = read  # the chief's address may have changed since the last round
            now = self._clock()
            result = entry.result
            if now - entry.finished > self._stale:
                result, entry.owed = self._unknown, True
            if entry.running or now - entry.finished < self._min_interval:
                return result
            entry.running = True
        self._submit(key, entry, read)
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
            self._submit(key, entry, read)
        return len(due)

    def _submit(self, key: Hashable, entry: _Entry, read: Callable[[], Any]) -> None:
        # entry.slow_until is written only by the job's own read, and there is at most one at a time.
        (self._slow if entry.slow_until is not None else self._pool).submit(self._run, key, entry, read)

    def _ticker(self, period: float) -> None:
        while not self._closed.wait(period):
            try:
                self.tick()
            except RuntimeError:  # the pool shut down under it: the operator is stopping
                return

    def _run(self, key: Hashable, entry: _Entry, read: Callable[[], Any]) -> None:
        started = self._clock()
        try:
            result = read()
        except Exception:  # a bug must not leave the job marked running for ever, nor pass for no progress
            log.exception("scrape of %s failed", key)
            result = self._unknown
        with self._lock:
            finished = self._clock()
            changed = result != entry.result
            owed, entry.owed = entry.owed, False
            entry.result, entry.finished, entry.running = result, finished, False
            entry.slow_until = slow_lane_until(entry.slow_until, finished - started, finished)
            current = self._entries.get(key) is entry
        if (changed or owed) and current:
            self._on_change(key)

    def forget(self, key: Hashable) -> None:
        """A job that is gone: its result is dropped (a scrape in flight ends unheard)."""
        with self._lock:
            self._entries.pop(key, None)

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._slow.shutdown(wait=False, cancel_futures=True)
