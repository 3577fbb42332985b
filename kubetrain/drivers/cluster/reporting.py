"""What the operator writes about a job: its status (as the engine decided it), the problems a round met
on the API (`report_*`, through `engine.note`), and the gauges of jobs by state and by why they wait."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from kubetrain.api.status import JobStatus, read_status, to_dict
from kubetrain.engine import engine
from kubetrain.engine.conditions import TERMINAL
from kubetrain.engine.engine import WAITING_REASONS
from . import kube
from .index import Key
from .state import Controller, JobState, Where

log = logging.getLogger("kubetrain.operator")

REPORT_AFTER_FAILURES = 3
"""Rounds that failed in a row on an API error before the error is shown on the job."""
API_PROBLEMS = {422: "ApiInvalid", 429: "ApiThrottled"}  # others: ApiError (5xx: the server's own trouble)


def last_status(body: dict[str, Any], state: JobState) -> JobStatus:
    """The job's status as last written (the API's copy may lag behind), to change freely."""
    return copy.deepcopy(state.status) if state.status is not None else read_status(body.get("status"))


def write_status(ctl: Controller, key: Key, state: JobState, old: JobStatus, new: JobStatus) -> None:
    """Patch the job's status to `new` when it differs from `old`; remember it as the last written."""
    before, after = to_dict(old), to_dict(new)
    if after != before:
        kube.patch_status(key[0], key[1], merge_patch(before, after))
    state.status = new
    ctl.count(key, state, gauge_key(new))


def gauge_key(status: JobStatus | None) -> Where:
    """Where a job counts in the state and waiting gauges."""
    return (status.state if status is not None else "Created"), waiting_reason(status)


def merge_patch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after` as a JSON merge patch over `before` (RFC 7386, what a status patch is): a key dropped at any
    depth is sent as null, or the API server would keep it. A nested one matters: memory.activeSince left
    in place after a pause, or a pendingRestarts entry, would be read back by an operator that restarts."""
    patch = dict(after)
    for name, old in before.items():
        if name not in after:
            patch[name] = None
        elif isinstance(old, dict) and isinstance(after[name], dict):
            patch[name] = merge_patch(old, after[name])
    return patch


def waiting_reason(status: JobStatus | None) -> str | None:
    """Why the job's replicas wait (one of WAITING_REASONS, read from its state's condition), or None.
    A finished job waits for nothing, whatever its reason (Failed: Unschedulable)."""
    if status is None or status.state in TERMINAL:
        return None
    for c in status.conditions:
        if c.type == status.state and c.status == "True" and c.reason in WAITING_REASONS:
            return c.reason
    return None


def report_api_error(ctl: Controller, body: dict[str, Any], state: JobState, key: Key, err: kube.KubeError) -> None:
    """Retried with backoff; shown on the job once it failed REPORT_AFTER_FAILURES rounds in a row."""
    ns, name = key
    failures = ctl.queue.failures(key) + 1
    log.warning("%s/%s: %s (failure %d in a row); retrying", ns, name, err, failures)
    if failures < REPORT_AFTER_FAILURES:
        return
    reason = API_PROBLEMS.get(err.status or 0, "ApiError")
    report_problem(ctl, body, state, reason, f"{err}; failed {failures} times in a row, retrying with backoff.")


def report_problem(ctl: Controller, body: dict[str, Any], state: JobState, reason: str, message: str) -> None:
    """The problem on the job's condition (`engine.note`: its state unchanged) and an Event, once."""
    meta = body["metadata"]
    log.error("%s/%s: %s", meta["namespace"], meta["name"], message)
    if state.problem == reason:
        return  # shown already
    old = last_status(body, state)
    try:
        noted = engine.note(old, engine.Problem(reason, message), time.time(), meta.get("generation", 0))
        write_status(ctl, (meta["namespace"], meta["name"]), state, old, noted)
        kube.record_event(body, "Warning", reason, message)
        state.problem = reason
    except kube.KubeError as second:
        log.error("%s/%s: cannot report that in the status either: %s", meta["namespace"], meta["name"], second)


def report_forbidden(ctl: Controller, body: dict[str, Any], state: JobState, err: kube.KubeError) -> None:
    """RBAC refused an operation: say which, in the log and (where still allowed) the job's status."""
    message = (f"{err}. The operator's ServiceAccount lacks this permission: the chart's Role or ClusterRole "
               "(charts/kubetrain/templates/rbac.yaml) grants it; retrying.")
    report_problem(ctl, body, state, "Forbidden", message)
