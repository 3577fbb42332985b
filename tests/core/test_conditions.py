"""Conditions are computed whole from the old list, the observation and the time."""

import pytest

from kubetrain.engine.conditions import Observed, conditions, state_of


def by_type(conds):
    return {c.type: c for c in conds}


def test_created_job_has_only_created():
    conds = conditions([], Observed("Created", "Created", "Pods created."), "t0", 1)
    assert [(c.type, c.status) for c in conds] == [("Created", "True")]
    assert conds[0].observed_generation == 1


def test_transition_time_kept_when_status_unchanged():
    c1 = conditions([], Observed("Running", "Running", "Training."), "t0", 1)
    c2 = conditions(c1, Observed("Running", "Running", "Training."), "t1", 2)
    assert by_type(c2)["Running"].last_transition_time == "t0"
    assert by_type(c2)["Running"].observed_generation == 2


def test_restart_then_running_again_keeps_history():
    c1 = conditions([], Observed("Running", "Running", "Training."), "t0", 1)
    c2 = conditions(c1, Observed("Restarting", "Killed", "worker-1 was killed by SIGKILL; restart 1 of 6."), "t1", 1)
    assert by_type(c2)["Running"].status == "False"
    assert by_type(c2)["Restarting"].reason == "Killed"
    assert state_of(c2) == "Restarting"
    c3 = conditions(c2, Observed("Running", "Running", "Training."), "t2", 1)
    assert by_type(c3)["Restarting"].status == "False"
    assert by_type(c3)["Restarting"].last_transition_time == "t2"
    assert by_type(c3)["Running"].last_transition_time == "t2"
    assert state_of(c3) == "Running"


@pytest.mark.parametrize("final", ["Succeeded", "Failed", "Suspended"])
def test_final_states(final):
    c1 = conditions([], Observed("Running", "Running", "Training."), "t0", 1)
    c2 = conditions(c1, Observed(final, "R", "m."), "t1", 1)
    assert state_of(c2) == final
    assert by_type(c2)[final].reason == "R"
    assert by_type(c2)["Created"].status == "True"


def test_unknown_state_is_refused():
    with pytest.raises(ValueError, match="unknown state 'Done'"):
        conditions([], Observed("Done", "X", "y"), "t", 1)


@pytest.mark.parametrize("problem", ["Forbidden", "ImagePullFailed", "VolumePending"])
def test_a_problem_reported_on_created_is_cleared_once_the_job_runs(problem):
    c1 = conditions(None, Observed("Created", problem, "create pod ns/j-worker-0: 403 ..."), "t1", 1)
    c2 = conditions(c1, Observed("Running", "Running", "The job's replicas are running."), "t2", 1)
    created = next(c for c in c2 if c.type == "Created")
    assert (created.status, created.reason, created.last_transition_time) == ("True", "Created", "t1")
