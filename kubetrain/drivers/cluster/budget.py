"""The bytes of pods the operator's rounds may render at once: one budget shared by every worker.

spec.MAX_RENDERED_TEMPLATE_BYTES bounds one job; this bounds them all together. 32 reconcile workers
(state.WORKERS) that each create a 1,096-pod job at the per-job bound would hold 32 x 37 MiB of rendered
pods at once, past the operator's 512 Mi. A round weighs what it may render (the pods its job lacks,
each its template and kubetrain's own part) and waits for that much of the budget before it renders;
a round that renders nothing (nearly all of them: its pods exist) weighs 0 and never waits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kubetrain.api import TrainingJob

RENDER_BUDGET_BYTES = 8 * 1024 * 1024
"""Pods' JSON rendered at once by all rounds together: at most about 75 MiB as Python objects (the
worst template, 37 MiB per 4 MiB of JSON: api/spec.MAX_RENDERED_TEMPLATE_BYTES). Two jobs at the per-job
bound render side by side; a third waits for one of them to create its pods."""
OWN_POD_BYTES = 8 * 1024
"""kubetrain's own part of a pod, as JSON (its trainer container, volumes, variables: 3-6 KB)."""


def template_bytes(job: TrainingJob) -> int:
    return len(json.dumps(job.spec.pod_template, separators=(",", ":"), default=str)) if job.spec.pod_template else 0


def render_weight(job: TrainingJob, observed: int) -> int:
    """What a round of `job` may render, with `observed` of its replicas seen: the pods it lacks (a
    DDP job's StatefulSet template is rendered whole, a pod's worth)."""
    missing = max(0, sum(job.spec.rendered_pods.values()) - observed)
    return missing * (template_bytes(job) + OWN_POD_BYTES)


class RenderBudget:
    """A shared budget of bytes, taken by `hold(weight)` and given back when its block ends. A weight
    above the whole budget takes all of it (one job at the bound never waits for ever)."""

    def __init__(self, total: int = RENDER_BUDGET_BYTES):
        self.total = total
        self.free = total
        self.peak_held = 0  # the most ever held at once: what the tests read
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, weight: int) -> Iterator[None]:
        take = min(weight, self.total)
        if take <= 0:
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: self.free >= take)
            self.free -= take
            self.peak_held = max(self.peak_held, self.total - self.free)
        try:
            yield
        finally:
            with self._cond:
                self.free += take
                self._cond.notify_all()
