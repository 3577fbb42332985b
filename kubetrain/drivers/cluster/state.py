"""The operator process's state, made once at start-up (`Controller`) and passed to the handlers, the
workers and every phase of a round: its configuration, the index of what the watches showed, the work
queue, the scrape pool, and what it remembers of each job (`JobState`). No module globals: a test
makes a Controller of its own.

Three objects hold a job's state, each for one purpose:
- `api.status.JobStatus`: the job's status as users read it, with what the engine remembers between
  rounds (`memory`); the only copy that survives a restart (the API server's, or a run directory's).
- `JobState` (here): what this operator process keeps of a job beside its status, a cache rebuilt
  after a restart (the status last written, children known to exist, pods just created).
- `local.rundir.RunState`: what only a local run keeps beside the status (wall time, invocations,
  the restart log).
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubetrain.api.status import JobStatus
from kubetrain.engine.children import Settings
from kubetrain.engine.conditions import TERMINAL
from kubetrain.engine.engine import MAX_REQUEUE_SECONDS
from . import metrics, scrapes
from .budget import RenderBudget
from .index import Index, Key
from .workqueue import WorkQueue

WORKERS = 32
"""Reconcile workers. A round is a few API calls (milliseconds each, seconds on a loaded API server) and
a worker waits through them, so the workers bound how many rounds are under way. At 1,000 jobs starting
at once, 8 were enough to create as fast as the machine's cores allowed, but the burst's status rounds
still queued when replicas failed right after it (a replacement's p50 0.31 s, p95 0.63 s); 32 finished
them sooner (p50 0.16 s, p95 0.21 s) for about 10 MB more (docs/benchmarks-history.md). Their creates share
CREATE_THREADS, so the rounds have at most WORKERS + URGENT_WORKERS + CREATE_THREADS requests under way."""
MAX_WORKERS = 64
"""The most `--workers` takes: the rounds share one interpreter (the GIL), and each worker holds an
API connection of its own; beyond this they only contend."""
CREATE_THREADS = 16
"""Threads that create a round's objects side by side, shared by every worker: a job's Secret,
NetworkPolicy, Services and claims at once, then its pods at once, instead of one round trip after
another (a ParameterServer job of 8 workers is a dozen creates). However many workers, at most 16
creates are in flight, far below the API server's default of 400 requests in flight; beyond that a round
waits for a thread."""


SAFETY_NET_ROUNDS_PER_SECOND = 10.0
"""The safety-net rounds (a look at a running job that no event, scrape or clock asked for) the operator
spends per second at most, all its jobs together: each job that has not ended gets one every
engine.MAX_REQUEUE_SECONDS (60 s) up to 600 such jobs, and every jobs / 10 seconds beyond (5,000 jobs:
every 500 s). At 60 s whatever the count, 5,000 running jobs cost 83 rounds a second (21.8 CPU s in a quiet
minute), and while thousands of jobs started these rounds were two thirds of the operator's rounds,
queued ahead of the new jobs' own and beside the replacements' for the one interpreter. A pod event the
watch missed is found by the resync (workers.RESYNC_SECONDS) whatever this period."""


def safety_net_seconds(jobs: int) -> float:
    """The safety net's period for an operator that holds `jobs` jobs."""
    return max(MAX_REQUEUE_SECONDS, jobs / SAFETY_NET_ROUNDS_PER_SECOND)


Where = tuple[str, str | None]
"""Where a job counts in the operator's gauges: (its state, why its replicas wait or None)."""
CREATED: Where = ("Created", None)
"""Where a job counts before a round wrote its status."""


class JobGauges:
    """kubetrain_operator_jobs{namespace,state} and kubetrain_operator_jobs_waiting{namespace,reason},
    counted as each job moves: O(1) a move. Counting every job again on each move was O(jobs) a move,
    and O(jobs²) while thousands of jobs start (each moves two or three times): 14 ms a count at 5,000
    jobs, 15,000 counts. A label whose count falls to 0 is removed, as a fresh count would leave it out.
    Not thread-safe: its one caller (`Controller`) holds its jobs' lock."""

    def __init__(self) -> None:
        self._where: dict[Key, Where] = {}
        self._states: dict[tuple[str, str], int] = {}
        self._waiting: dict[tuple[str, str], int] = {}
        self.unfinished = 0  # jobs in no terminal state: those the safety net looks at

    def move(self, key: Key, where: Where | None) -> None:
        """Count the job `key` at `where`; None: it is gone."""
        old = self._where.pop(key, None)
        if where is not None:
            self._where[key] = where
        if old == where:
            return
        self.unfinished += _unfinished(where) - _unfinished(old)
        for place, step in ((old, -1), (where, 1)):
            if place is not None:
                state, why = place
                _bump(self._states, metrics.JOBS_BY_STATE, (key[0], state), step)
                if why is not None:
                    _bump(self._waiting, metrics.JOBS_WAITING, (key[0], why), step)


def _unfinished(where: Where | None) -> int:
    return int(where is not None and where[0] not in TERMINAL)


def _bump(counts: dict[tuple[str, str], int], gauge: Any, labels: tuple[str, str], step: int) -> None:
    n = counts.get(labels, 0) + step
    if n > 0:
        counts[labels] = n
        gauge.labels(*labels).set(n)
    else:
        counts.pop(labels, None)
        gauge.remove(*labels)


@dataclass
class OperatorConfig:
    """The operator's settings, from its command line (drivers/cluster/run.py)."""

    settings: Settings = field(default_factory=Settings)
    scrape_networks: list[str] = field(default_factory=list)  # empty: scrape any pod IP
    scrape: bool = True
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    workers: int = WORKERS
    kueue: bool = False  # jobs labelled kueue.x-k8s.io/queue-name wait for Kueue's admission (handlers.register watches their Workloads)
    kueue_slices: bool = False  # a queued fault-tolerant job resizes live by Workload slices (Kueue's ElasticJobsViaWorkloadSlices gate)


@dataclass
class JobState:
    """What this operator process remembers of a job beside its status: a cache, rebuilt after a restart
    (what must survive one is in the status's memory, `api.status.JobMemory`)."""

    status: JobStatus | None = None  # the last status written: the watch's copy may lag behind
    existing: set[tuple[str, str]] = field(default_factory=set)  # (kind, name) of children known to exist
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    counted_created: bool = False
    expected: dict[str, float] = field(default_factory=dict)  # replica -> when its pod was created (monotonic)
    problem: str | None = None  # the API problem reason shown on the job, if any
    placements: tuple[str, dict[str, Any]] | None = None  # (the Workload's admission as JSON, role -> Placement)
    pod_security: tuple[tuple[str, int], list[str]] | None = None  # ((uid, generation), its refusals)


class Controller:
    """The operator's state: made at start-up (drivers/cluster/run.py), given to the kopf handlers
    (`handlers.register`), the workers and every round."""

    def __init__(self, config: OperatorConfig | None = None, scrape_tick: float | None = scrapes.TICK_SECONDS):
        """`scrape_tick`: the scrape ticker's period; None starts none (a test's controller)."""
        self.config = config or OperatorConfig()
        self.index = Index()
        self.queue = WorkQueue(on_wait=lambda lane, seconds: metrics.WORKQUEUE_WAIT_SECONDS.labels(lane).observe(seconds))
        for lane in ("urgent", "routine"):
            metrics.WORKQUEUE_DEPTH.labels(lane).set_function(lambda lane=lane: self.queue.depth()[lane])  # type: ignore[misc]  # a lambda's default binds the lane
        self.scrapes = scrapes.Scrapes(on_change=self.queue.add, tick=scrape_tick)
        self.jobs: dict[Key, JobState] = {}
        self.jobs_lock = threading.Lock()
        self.gauges = JobGauges()  # under jobs_lock
        self.workers: list[threading.Thread] = []
        self.creators = ThreadPoolExecutor(max_workers=CREATE_THREADS, thread_name_prefix="create")
        self.render_budget = RenderBudget()  # the pods every round together may render at once

    def job_state(self, key: Key) -> JobState:
        with self.jobs_lock:
            state = self.jobs.get(key)
            if state is None:
                state = self.jobs[key] = JobState()
                self.gauges.move(key, CREATED)
            return state

    def count(self, key: Key, state: JobState, where: Where) -> None:
        """Count the job at `where` in the gauges, if `state` is still its state: a round that ends after
        its job was deleted (and forgotten) counts nothing."""
        with self.jobs_lock:
            if self.jobs.get(key) is state:
                self.gauges.move(key, where)

    def safety_net(self) -> float:
        """The safety net's period now (`safety_net_seconds` of the jobs this operator holds that have not
        ended)."""
        with self.jobs_lock:
            return safety_net_seconds(self.gauges.unfinished)

    def known_job(self, key: Key) -> JobState | None:
        """The job's state if a round made one; None otherwise (never makes one)."""
        with self.jobs_lock:
            return self.jobs.get(key)

    def forget_job(self, key: Key) -> None:
        with self.jobs_lock:
            self.jobs.pop(key, None)
            self.gauges.move(key, None)

    def job_states(self) -> list[tuple[Key, JobState]]:
        with self.jobs_lock:
            return list(self.jobs.items())

    def close(self) -> None:
        """Stop the workers (after their round) and the scrape pool."""
        self.queue.close()
        self.scrapes.close()
