"""The operator's jobs-by-state and waiting gauges are counted as each job moves (state.JobGauges), not by
counting every job again on each move (O(jobs²) while thousands of jobs start); the count of jobs that
have not ended sets the safety net's period (state.safety_net_seconds). A narrow unit test of the
counting against a full recount of the jobs' states; that the real operator's /metrics shows the gauges is
tests/operator/test_operator_metrics.py's, and the waiting gauge's reasons tests/operator/test_scheduling.py's."""

from __future__ import annotations

import random

import pytest

from kubetrain.api.status import read_status
from kubetrain.drivers.cluster import metrics
from kubetrain.drivers.cluster.handlers import on_job
from kubetrain.drivers.cluster.reporting import gauge_key, write_status
from kubetrain.drivers.cluster.state import SAFETY_NET_ROUNDS_PER_SECOND, Controller, safety_net_seconds

PLACES = [("Created", None), ("Pending", None), ("Pending", "Unschedulable"), ("Pending", "ImagePullFailed"),
          ("Running", None), ("Succeeded", None), ("Failed", None)]


@pytest.fixture
def ctl():
    metrics.JOBS_BY_STATE.clear()  # the process's gauges: another test's controller may have counted in them
    metrics.JOBS_WAITING.clear()
    c = Controller(scrape_tick=None)
    yield c
    for key, _ in c.job_states():  # leave the process's gauges as a fresh operator's
        c.forget_job(key)
    c.close()


def status(state: str, why: str | None) -> dict:
    conditions = [] if why is None else [{"type": state, "status": "True", "reason": why, "message": "m",
                                          "lastTransitionTime": "2026-12-03T10:00:00Z"}]
    return {"state": state, "conditions": conditions}


def shown(gauge) -> dict[tuple[str, str], float]:
    """What /metrics would show of `gauge`: its samples by their two labels."""
    return {tuple(s.labels.values()): s.value for m in gauge.collect() for s in m.samples}


def recount(ctl: Controller) -> tuple[dict, dict]:
    """Every job counted afresh: what the gauges must equal."""
    states: dict[tuple[str, str], float] = {}
    waiting: dict[tuple[str, str], float] = {}
    for (ns, _), job in ctl.job_states():
        state, why = gauge_key(job.status)
        states[(ns, state)] = states.get((ns, state), 0) + 1
        if why is not None:
            waiting[(ns, why)] = waiting.get((ns, why), 0) + 1
    return states, waiting


def test_random_moves_and_deletions_leave_the_gauges_equal_to_a_recount(ctl, monkeypatch):
    monkeypatch.setattr("kubetrain.drivers.cluster.kube.patch_status", lambda *a, **k: None)
    rng = random.Random(7)
    keys = [(f"ns{n % 3}", f"j{n}") for n in range(40)]
    for step in range(2000):
        key = rng.choice(keys)
        if rng.random() < 0.1:
            on_job(ctl, {"type": "DELETED", "object": {"metadata": {"namespace": key[0], "name": key[1]}}})
        else:
            state = ctl.job_state(key)
            old = state.status if state.status is not None else read_status({})
            write_status(ctl, key, state, old, read_status(status(*rng.choice(PLACES[1:]))))
        assert (shown(metrics.JOBS_BY_STATE), shown(metrics.JOBS_WAITING)) == recount(ctl), f"after step {step}"
    assert shown(metrics.JOBS_BY_STATE), "some jobs are left to count"


def test_a_state_no_job_is_in_any_more_leaves_the_gauge(ctl):
    key = ("ns", "j")
    state = ctl.job_state(key)
    assert shown(metrics.JOBS_BY_STATE) == {("ns", "Created"): 1}
    ctl.count(key, state, ("Pending", "Unschedulable"))
    assert shown(metrics.JOBS_BY_STATE) == {("ns", "Pending"): 1}
    assert shown(metrics.JOBS_WAITING) == {("ns", "Unschedulable"): 1}
    ctl.count(key, state, ("Running", None))
    assert shown(metrics.JOBS_BY_STATE) == {("ns", "Running"): 1}
    assert shown(metrics.JOBS_WAITING) == {}
    ctl.forget_job(key)
    assert shown(metrics.JOBS_BY_STATE) == {}


def test_a_round_that_ends_after_its_job_was_deleted_counts_nothing(ctl):
    key = ("ns", "j")
    state = ctl.job_state(key)  # the round began
    ctl.forget_job(key)  # the job's DELETED event meanwhile
    ctl.count(key, state, ("Running", None))  # the round's status write
    assert shown(metrics.JOBS_BY_STATE) == {}
    again = ctl.job_state(key)  # a new job of the same name: counted once, as new
    ctl.count(key, state, ("Failed", None))  # the old round again: not this job's state
    assert again is not state and shown(metrics.JOBS_BY_STATE) == {("ns", "Created"): 1}


@pytest.mark.parametrize("jobs, period", [(0, 60.0), (600, 60.0), (601, 60.1), (5000, 500.0), (1_000_000, 100_000.0)])
def test_the_safety_net_spends_at_most_its_rounds_a_second(jobs, period):
    assert safety_net_seconds(jobs) == pytest.approx(period)
    assert jobs / safety_net_seconds(jobs) <= SAFETY_NET_ROUNDS_PER_SECOND


def test_the_safety_net_follows_the_jobs_that_have_not_ended(ctl):
    keys = [("ns", f"j{n}") for n in range(1200)]
    states = [ctl.job_state(key) for key in keys]  # new jobs: Created, unfinished
    assert ctl.safety_net() == pytest.approx(120.0)
    for key, state in zip(keys[:300], states):
        ctl.count(key, state, ("Running", None))
    assert ctl.safety_net() == pytest.approx(120.0)  # running is unfinished too
    for key, state in zip(keys[:700], states):
        ctl.count(key, state, ("Succeeded", None))
    assert ctl.safety_net() == pytest.approx(60.0)  # 500 left: the engine's own period
    for key in keys[700:]:
        ctl.forget_job(key)
    assert ctl.gauges.unfinished == 0
