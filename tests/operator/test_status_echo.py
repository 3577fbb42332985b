"""A job's event that only shows the status the operator last wrote is its own write's echo, and is not
queued (handlers.own_status_echo); anything else about the job is. A narrow unit test of the handler over
the job bodies a watch delivers; that the status the operator writes reads back unchanged from the real
API server (so that an echo is recognised) is in tests/operator/test_lifecycle.py."""

from __future__ import annotations

import copy

import pytest

from kubetrain.api.status import read_status, to_dict
from kubetrain.drivers.cluster.handlers import on_job
from kubetrain.drivers.cluster.state import Controller

STATUS = {"state": "Running", "replicas": 3, "restarts": 0, "startTime": "2026-12-03T10:00:00Z",
          "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "all replicas run",
                          "lastTransitionTime": "2026-12-03T10:00:01Z", "observedGeneration": 1}]}


def body(rv: str, status: dict | None = None, **meta) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1, "resourceVersion": rv,
                         "labels": {"team": "a"}, **meta},
            "spec": {"mode": "ParameterServer", "parameterServer": {"replicas": 1}, "workers": 2},
            "status": status if status is not None else {}}


@pytest.fixture
def ctl():
    c = Controller(scrape_tick=None)
    yield c
    c.close()


def seen(ctl: Controller, status: dict) -> None:
    """The job as the watch first showed it, reconciled once: the operator wrote `status`."""
    on_job(ctl, {"type": "ADDED", "object": body("1")})
    assert ctl.queue.get(timeout=0) == ("ns", "j")
    ctl.queue.done(("ns", "j"))
    ctl.job_state(("ns", "j")).status = read_status(status)


def test_the_event_of_the_operators_own_status_write_is_not_queued(ctl):
    seen(ctl, STATUS)
    on_job(ctl, {"type": "MODIFIED", "object": body("2", to_dict(read_status(STATUS)), managedFields=[{"x": 1}])})
    assert len(ctl.queue) == 0
    assert ctl.index.job(("ns", "j"))["metadata"]["resourceVersion"] == "2"  # the index has it all the same


@pytest.mark.parametrize("change", ["status", "spec", "labels", "annotations", "deletionTimestamp", "finalizers",
                                    "generation"])
def test_anything_else_that_changed_is_queued(ctl, change):
    seen(ctl, STATUS)
    status = to_dict(read_status(STATUS))
    new = body("2", status)
    if change == "status":  # someone else's write, or one this operator has not recorded yet
        new["status"] = {**status, "restarts": 1}
    elif change == "spec":
        new["spec"]["workers"] = 3
    elif change == "labels":
        new["metadata"]["labels"] = {"team": "b"}
    elif change == "annotations":
        new["metadata"]["annotations"] = {"a": "b"}
    elif change == "generation":
        new["metadata"]["generation"] = 2
    else:
        new["metadata"][change] = "2026-12-03T10:00:02Z" if change == "deletionTimestamp" else ["x"]
    on_job(ctl, {"type": "MODIFIED", "object": copy.deepcopy(new)})
    assert ctl.queue.get(timeout=0) == ("ns", "j")


def test_a_job_no_round_has_seen_is_queued(ctl):
    on_job(ctl, {"type": "ADDED", "object": body("1", to_dict(read_status(STATUS)))})
    on_job(ctl, {"type": "MODIFIED", "object": body("2", to_dict(read_status(STATUS)))})
    assert ctl.queue.get(timeout=0) == ("ns", "j")
